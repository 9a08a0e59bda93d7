"""`python -m loadgen`: the load generator (cli.py); `tsukimi-loadgen` is this and the experiment harness
(`shared.tools.loadgen_command`)."""

from __future__ import annotations

import sys

from loadgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
