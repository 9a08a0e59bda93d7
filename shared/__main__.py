"""`python -m shared` runs the `tsukimi` command."""

import sys

from shared.tools.cli.main import main

sys.exit(main())
