"""Entry point of `tsukimi-loadgen`. The load generator lands with the services; until then it says so plainly."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tsukimi-loadgen",
        description="Load generator for OpenAI-compatible servers (Mooncake trace replay, Poisson/Gamma arrivals, "
        "TTFT/TBT/goodput). Not built yet: it arrives with the disaggregated services. Use `tsukimi bench engine` "
        "to measure the engine today.",
    )
    parser.parse_args(argv)
    parser.exit(2, "tsukimi-loadgen: not available yet in this version; see `tsukimi bench engine`\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
