"""``python -m shmstage_bench``; the guard matters because peers spawn processes."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
