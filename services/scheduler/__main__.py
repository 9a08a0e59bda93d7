"""`python -m services.scheduler`: the scheduler service, configured by `TSUKIMI_*` variables."""

from __future__ import annotations

from services.common.lifecycle import run_service
from services.scheduler.service import SchedulerService
from shared.config import SchedulerSettings
from shared.wire.bus import Bus
from shared.wire.protocol import Role


async def build(settings: SchedulerSettings, bus: Bus) -> SchedulerService:
    return SchedulerService(settings, bus)


def main() -> None:
    run_service(Role.SCHEDULER, SchedulerSettings, build)


if __name__ == "__main__":
    main()
