"""``python -m vlmbatch``: the command line."""

import sys

from vlmbatch.cli import main

sys.exit(main())
