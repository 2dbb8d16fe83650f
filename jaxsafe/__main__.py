"""`python -m jaxsafe explain package.module:function --arg f32[8,3]` (see `_cli.py`)."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
