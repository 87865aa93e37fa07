"""``python -m tpo_kernels.bench.kernel_report``."""

import sys

from .table import main

sys.exit(main())
