"""What one run of the Mooncake experiment is: which system, policy and load, and, for the studies beyond the main
sweep (studies.py), which point of which study with which settings and pools. No running here."""

from __future__ import annotations

from dataclasses import dataclass

TSUKIMI, BASELINE = "tsukimi", "baseline"


@dataclass(frozen=True)
class PlannedRun:
    """One run.

    Attributes:
        system: TSUKIMI (prefill and decode pools) or BASELINE (colocated instances).
        policy: the scheduler's placement policy.
        time_scale: the trace's arrival times multiplied by this.
        study: "" for the main sweep and the policy comparison, else the study (studies.STUDIES) it belongs to.
        variant: the study's point (a baseline's name, a pool size, "5P11D", a rejection mode, a codec).
        env: settings on top of the experiment's, for every instance.
        pools: (prefill, decode) instead of the experiment's.
        max_output_tokens: outputs capped (1: prefill alone).
    """

    system: str
    policy: str
    time_scale: float
    study: str = ""
    variant: str = ""
    env: tuple[tuple[str, str], ...] = ()
    pools: tuple[int, int] | None = None
    max_output_tokens: int | None = None
