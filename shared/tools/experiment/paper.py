"""The paper's figures for the trace being replayed: Mooncake reported different experiments on different traces, and a
trace it never used has no figures to stand beside ours."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PaperFigures:
    """What the paper reported on one trace; empty where it reported nothing comparable."""

    trace: str  # the paper's name for the trace, "" for a trace it did not use
    capacity_source: str = ""  # which figure the capacity ratios come from
    capacity_ratio: dict[str, float] = field(default_factory=dict)  # TBT SLO (ms) -> Mooncake / vLLM
    avg_ttft_s: dict[str, float] = field(default_factory=dict)  # placement policy -> seconds
    hit_rate_global_over_local: float | None = None
    rejections: dict[str, int] = field(default_factory=dict)  # rejection mode -> rejected requests

    def json(self) -> dict[str, Any]:
        return {"trace": self.trace or None, "effective_capacity_ratio": self.capacity_ratio,
                "avg_ttft_s_by_policy": self.avg_ttft_s,
                "hit_rate_global_over_local": self.hit_rate_global_over_local, "rejections": self.rejections}


# Mooncake (FAST'25), conversation trace, 16 nodes of 8xA800, LLaMA-3-70B-sized dummy model: effective request capacity
# over the best vLLM configuration at TTFT 30 s and TBT 100/200/300 ms (+498%, +157%, +59%, Fig. 1), the average TTFT
# of each placement policy (Fig. 5), the global pool at 2.22x the local caches' hit rate (Fig. 10); arXiv v1's Table
# 3, rejected requests of 8P+8D at 2x replay speed by rejection mode.
CONVERSATION = PaperFigures(
    trace="conversation", capacity_source="FAST'25 Fig. 1",
    capacity_ratio={"100": 5.98, "200": 2.57, "300": 1.59},
    avg_ttft_s={"conductor": 3.07, "local_cache_aware": 3.58, "least_loaded": 5.27, "random": 19.65},
    hit_rate_global_over_local=2.22,
    rejections={"off": 4183, "current": 3771, "predicted": 3589},
)
# FAST'25 Fig. 7, the synthetic trace: +62%, +40%, +28% effective request capacity at TBT 100/200/300 ms.
SYNTHETIC = PaperFigures(trace="synthetic", capacity_source="FAST'25 Fig. 7",
                         capacity_ratio={"100": 1.62, "200": 1.40, "300": 1.28})
NONE = PaperFigures(trace="")


def paper_figures(trace: Path) -> PaperFigures:
    """The paper's figures for `trace`, recognised by the file names Mooncake published them under."""
    name = trace.name
    if name.startswith("conversation_trace"):
        return CONVERSATION
    if name.startswith("synthetic_trace"):
        return SYNTHETIC
    return NONE
