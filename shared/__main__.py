"""`python -m shared` runs the `tsukimi` command."""

import sys

from shared.cli.main import main

sys.exit(main())
