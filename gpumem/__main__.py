"""``python -m gpumem``: the gpumem command line (see gpumem.cli)."""
import sys

from gpumem.cli import main

if __name__ == "__main__":
    sys.exit(main())
