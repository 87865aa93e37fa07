"""Entry point of the fresh subprocess that runs one isolated CPU measurement."""

import sys

from .harness import worker_main

if __name__ == "__main__":
    sys.exit(worker_main())
