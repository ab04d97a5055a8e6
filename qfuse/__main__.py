"""``python -m qfuse``: the ``qfuse`` command line (``qfuse.cli``)."""

import sys

from qfuse.cli import main

sys.exit(main())
