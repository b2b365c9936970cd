"""``python -m pagedkv.sim simulate|size ...``."""

import sys

from pagedkv.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
