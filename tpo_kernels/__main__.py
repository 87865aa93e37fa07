"""``python -m tpo_kernels {status,demo,bench}``."""

import sys

from .cli import main

sys.exit(main())
