"""``python -m tensormp doctor | ls | gc``: the same as the ``tensormp`` console script."""

import sys

from .cli import main

sys.exit(main())
