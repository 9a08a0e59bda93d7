"""`python -m services.virtual`: replay a Mooncake-format trace against a whole simulated cluster in this one process,
on a virtual clock (see `cli.py`).

The clock is installed before anything else is imported: the services keep `time.monotonic` as a default argument,
and those defaults must be the virtual clock's.
"""

from services.virtual import clock

clock.install()

from services.virtual.cli import main  # noqa: E402 -- after the clock is installed, on purpose

if __name__ == "__main__":
    raise SystemExit(main())
