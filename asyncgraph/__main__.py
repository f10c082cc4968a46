"""``python -m asyncgraph ...``: the same as the ``asyncgraph`` command."""

import sys

from .cli import main

sys.exit(main())
