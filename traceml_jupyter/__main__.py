"""`python -m traceml_jupyter run -- python train.py`: the command line (cli.py)."""

import sys

from .cli import main

sys.exit(main())
