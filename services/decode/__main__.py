"""`python -m services.decode`: the decode service, configured by `TSUKIMI_*` variables."""

from __future__ import annotations

from services.common.engine_host import load_engine
from services.common.lifecycle import run_service
from services.decode.service import DecodeService
from shared.config import EngineSettings
from shared.wire.bus import Bus
from shared.wire.protocol import Role


async def build(settings: EngineSettings, bus: Bus) -> DecodeService:
    engine = await load_engine(settings)
    return DecodeService(settings, bus, engine)


def main() -> None:
    run_service(Role.DECODE, EngineSettings, build)


if __name__ == "__main__":
    main()
