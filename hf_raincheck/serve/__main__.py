"""``python -m hf_raincheck.serve [MODEL] [options]``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m hf_raincheck.serve"))
