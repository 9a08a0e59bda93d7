"""`python -m services.scheduler`: the scheduler service, configured by `TSUKIMI_*` variables."""

from __future__ import annotations

from services.scheduler.service import SchedulerService
from shared.bus import Bus, run_service
from shared.config import Settings
from shared.protocol import Role


async def build(settings: Settings, bus: Bus) -> SchedulerService:
    return SchedulerService(settings, bus)


def main() -> None:
    run_service(Role.SCHEDULER, build)


if __name__ == "__main__":
    main()
