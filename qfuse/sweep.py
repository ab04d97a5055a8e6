"""``python -m qfuse.sweep ...`` is ``qfuse sweep ...`` (the code lives in ``qfuse/tools``)."""

import sys

from qfuse.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
