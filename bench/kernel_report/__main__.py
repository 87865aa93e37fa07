"""``python -m bench.kernel_report``."""

import sys

from .table import main

sys.exit(main())
