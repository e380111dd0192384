"""``python -m vlmbatch``: the command line."""

import sys

from vlmbatch.app.cli import main

sys.exit(main())
