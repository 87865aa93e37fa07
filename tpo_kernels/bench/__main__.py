"""``python -m tpo_kernels.bench ...`` (same as ``tpo-kernels bench ...``)."""

import sys

from .run import main

sys.exit(main())
