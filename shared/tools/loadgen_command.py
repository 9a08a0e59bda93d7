"""`tsukimi-loadgen`: the load generator (`loadgen.cli`), and `tsukimi-loadgen experiment ...`, the experiment harness
(`shared.tools.experiment`), which starts whole systems and so belongs to the tools, not to the load generator."""

from __future__ import annotations

import importlib
import sys

from loadgen.cli import main as loadgen_main


def main(argv: list[str] | None = None) -> int:
    """Run the command; the experiment is imported only when asked for. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "experiment":
        experiment = importlib.import_module("shared.tools.experiment")
        return int(experiment.main(argv[1:]) or 0)
    return loadgen_main(argv)
