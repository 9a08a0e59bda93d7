"""Early rejection: refuse, before any prefill work, a request whose best placement is predicted to miss its SLOs.

Mode `current` judges decode on its load now; `predicted` (Mooncake's prediction-based early rejection) on its load
when this request would reach it, counting requests predicted to finish by then, which avoids the oscillation of
rejecting on a momentarily full decode pool that is about to drain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.scheduler.estimates import ClusterView
from services.scheduler.policies import Placement
from shared.wire.protocol import SubmitRequest


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    reason_code: str = ""  # "ttft_slo" or "tbt_slo"
    reason: str = ""
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class Slos:
    ttft_s: float
    tbt_s: float
    mode: str  # "off", "current", "predicted"

    def for_request(self, request: SubmitRequest) -> tuple[float, float]:
        """A request may tighten the SLOs, never loosen them."""
        return min(self.ttft_s, request.ttft_slo_s or math.inf), min(self.tbt_s, request.tbt_slo_s or math.inf)


def admit(request: SubmitRequest, placement: Placement, view: ClusterView, slos: Slos) -> Verdict:
    """Accept, or reject with a reason and a `Retry-After` hint. A request placed again after its instance was lost
    is work already accepted: its client is waiting, maybe mid-answer."""
    if slos.mode == "off" or request.num_placed_before:
        return Verdict(True)
    ttft_slo, tbt_slo = slos.for_request(request)
    ttft = placement.prefill.ttft_s
    if ttft > ttft_slo:
        return Verdict(
            False, "ttft_slo",
            f"overloaded: predicted time to first token {ttft:.2f} s exceeds the SLO of {ttft_slo:.2f} s",
            retry_after_s=max(1.0, ttft - ttft_slo),
        )
    decode = next(b for b in view.decodes if b.instance_id == placement.decode_id)
    at_time = view.now + ttft if slos.mode == "predicted" else None
    ends = [t.decode_end for t in view.tracked.values() if t.decode_id == decode.instance_id]
    retry_after_s = max(1.0, min(ends, default=view.now + 1.0) - view.now)
    if not view.has_seat(decode, at_time):
        return Verdict(False, "tbt_slo", f"overloaded: {decode.instance_id}'s batch is full ({decode.max_num_seqs} "
                                         "sequences); the request would wait there for one to finish", retry_after_s)
    tbt = view.judged_tbt_s(decode, at_time, request)
    if tbt > tbt_slo:
        return Verdict(
            False, "tbt_slo",
            f"overloaded: predicted time between tokens {1000 * tbt:.0f} ms on {decode.instance_id} (its slowest "
            f"tenth of gaps) exceeds the SLO of {1000 * tbt_slo:.0f} ms", retry_after_s,
        )
    return Verdict(True)
