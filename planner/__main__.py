"""``python -m planner``: the command line of :mod:`planner.cli`."""

import sys

from .cli import main

sys.exit(main())
