"""Entry point of `tsukimi-loadgen` and `python -m loadgen` (the command itself is in cli.py)."""

from __future__ import annotations

import sys

from loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
