"""``python -m vlmbatch``: the command line."""

import sys

from vlmbatch.cli.main import main

sys.exit(main())
