"""Placement policies (`TSUKIMI_POLICY`): where a request's prefill and decode run. `random`, `round_robin`,
`least_loaded` and `local_cache_aware` are the baselines the paper compares with; `conductor` is Mooncake's
KVCache-centric scheduler (DESIGN section 5); `ColocatedPolicy` routes a deployment without a prefill pool (the
vLLM-style baseline). Admission against the SLOs is `admission.py`, the same for all.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Protocol

from services.scheduler.estimates import ClusterView, PrefillOption
from shared.wire.protocol import Heartbeat, SubmitRequest

# SGLang's router: loads are "far apart" when max - min > 64 queued requests and max > 1.5 min; in prompt tokens here.
HERD_MIN_GAP_TOKENS = 4096
HERD_RATIO = 1.5


@dataclass(frozen=True)
class Placement:
    """Where a request goes and what the scheduler predicts for it."""

    prefill: PrefillOption  # on_decode: the decode instance computes the prompt itself
    decode_id: str
    on_decode: bool
    tbt_s: float


class Policy(Protocol):
    name: str

    def place(self, request: SubmitRequest, view: ClusterView) -> Placement: ...


def _least_loaded_decode(view: ClusterView, request: SubmitRequest) -> tuple[Heartbeat, float]:
    best = min(view.decodes, key=lambda b: (view.decode_batch(b, None), b.kv_blocks_used, b.instance_id))
    return best, view.tbt_s(best, None, len(request.prompt_ids))


def _placement(view: ClusterView, request: SubmitRequest, prefill: Heartbeat, use_pool: bool,
               decode: tuple[Heartbeat, float]) -> Placement:
    return Placement(view.prefill_option(prefill, request, use_pool), decode[0].instance_id, False, decode[1])


class RandomPolicy:
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def place(self, request: SubmitRequest, view: ClusterView) -> Placement:
        decode = self._rng.choice(view.decodes)
        return _placement(view, request, self._rng.choice(view.prefills), False,
                          (decode, view.tbt_s(decode, None, len(request.prompt_ids))))


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def place(self, request: SubmitRequest, view: ClusterView) -> Placement:
        turn = next(self._counter)
        decode = view.decodes[turn % len(view.decodes)]
        return _placement(view, request, view.prefills[turn % len(view.prefills)], False,
                          (decode, view.tbt_s(decode, None, len(request.prompt_ids))))


class LeastLoadedPolicy:
    name = "least_loaded"

    def place(self, request: SubmitRequest, view: ClusterView) -> Placement:
        prefill = min(view.prefills, key=lambda b: (view.queue_s(b), b.instance_id))
        return _placement(view, request, prefill, False, _least_loaded_decode(view, request))


class LocalCacheAwarePolicy:
    """The instance with the longest local prefix hit wins (ties: least queued); the pool is not used."""

    name = "local_cache_aware"

    def place(self, request: SubmitRequest, view: ClusterView) -> Placement:
        options = [view.prefill_option(b, request, use_pool=False) for b in view.prefills]
        best = max(options, key=lambda o: (o.num_local_blocks, -o.queue_s, o.instance_id))
        decode, tbt = _least_loaded_decode(view, request)
        return Placement(best, decode.instance_id, False, tbt)


class ConductorPolicy:
    """Mooncake's Conductor: for each prefill instance, TTFT = queue + prefill of what is not reused (local prefix,
    or the pool's when it is `balance_ratio` times longer, paying its fetch) -> argmin; decode by lowest predicted
    TBT; a short prompt may be prefilled on the decode instance when that is predicted faster (conditional
    disaggregation); and when queues are far apart the least loaded wins over the best cache hit (herd guard).

    Args:
        local_prefill_tokens: most tokens to compute for a prefill on the decode instance (0: never).
        tbt_slo_s: a prefill on decode delays that instance's next token: the step computing it (with the prompts
            queued there and the decode batch) must fit in the TBT SLO.
    """

    name = "conductor"

    def __init__(self, local_prefill_tokens: int, tbt_slo_s: float) -> None:
        self.local_prefill_tokens, self.tbt_slo_s = local_prefill_tokens, tbt_slo_s

    def place(self, request: SubmitRequest, view: ClusterView) -> Placement:
        options = [view.prefill_option(b, request, use_pool=True) for b in view.prefills]
        best = min(options, key=lambda o: (o.ttft_s, o.queue_s, o.instance_id))
        best = self._herd_guard(best, options, view)
        decode = min(view.decodes, key=lambda b: (view.tbt_s(b, None, len(request.prompt_ids)),
                                                  view.decode_batch(b, None), b.instance_id))
        tbt = view.tbt_s(decode, None, len(request.prompt_ids))
        on_decode = self._prefill_on_decode(request, view, best, decode)
        return Placement(on_decode or best, decode.instance_id, on_decode is not None, tbt)

    def _herd_guard(self, best: PrefillOption, options: list[PrefillOption], view: ClusterView) -> PrefillOption:
        queued = {b.instance_id: b.num_queued_tokens for b in view.prefills}
        least = min(options, key=lambda o: (queued[o.instance_id], o.instance_id))
        gap = queued[best.instance_id] - queued[least.instance_id]
        if gap > HERD_MIN_GAP_TOKENS and queued[best.instance_id] > HERD_RATIO * queued[least.instance_id]:
            return least
        return best

    def _prefill_on_decode(self, request: SubmitRequest, view: ClusterView, best: PrefillOption,
                           decode: Heartbeat) -> PrefillOption | None:
        """Moving KV costs more than computing a short prompt where it is decoded, when the prefill pool is busy; but
        the step that computes it (with the prompts queued there before it) is a gap every request decoding there
        sees, and must fit the TBT SLO."""
        num_tokens = len(request.prompt_ids)
        if num_tokens > self.local_prefill_tokens or not view.has_seat(decode, None):
            return None
        queued = view.local_prefill_tokens(decode)
        if view.interleaved_step_s(decode, None, num_tokens, queued + num_tokens) > self.tbt_slo_s:
            return None
        compute = view.prefill_cost.predict(num_tokens, 0)
        # it joins the instance's next step, behind the prompts queued there
        wait = view.tbt_s(decode, None, num_tokens) + (view.prefill_cost.predict(queued, 0) if queued else 0.0)
        prefill_route = best.ttft_s + view.transfer_s(request, decode)
        if wait + compute >= prefill_route:
            return None
        return PrefillOption(decode.instance_id, 0, 0, False, wait, compute, 0.0)


class ColocatedPolicy:
    """A colocated deployment, the vLLM-style baseline Mooncake compares with: every instance prefills (chunked,
    with its own prefix cache) and decodes its own requests; `route` picks the instance: `random`, `round_robin`, or
    `least_loaded` (fewest sequences, counting placements its heartbeat does not show yet).

    Raises:
        ValueError: a route that needs a prefill pool.
    """

    ROUTES = ("random", "round_robin", "least_loaded")

    def __init__(self, route: str, seed: int | None = None) -> None:
        if route not in self.ROUTES:
            raise ValueError(f"a colocated deployment routes with {', '.join(self.ROUTES)}, not {route!r}")
        self.name, self._rng, self._counter = f"colocated_{route}", random.Random(seed), itertools.count()
        self.route = route

    def place(self, request: SubmitRequest, view: ClusterView) -> Placement:
        if self.route == "random":
            instance = self._rng.choice(view.decodes)
        elif self.route == "round_robin":
            instance = view.decodes[next(self._counter) % len(view.decodes)]
        else:
            instance = min(view.decodes, key=lambda b: (view.decode_batch(b, None), b.kv_blocks_used, b.instance_id))
        num_tokens = len(request.prompt_ids)
        tbt = view.tbt_s(instance, None, num_tokens)
        option = PrefillOption(instance.instance_id, 0, 0, False, tbt, view.prefill_cost.predict(num_tokens, 0), 0.0)
        return Placement(option, instance.instance_id, True, tbt)


def make_policy(name: str, local_prefill_tokens: int, tbt_slo_s: float, colocated: bool = False,
                seed: int | None = None) -> Policy:
    """The policy `name`; with `colocated`, the routing of a deployment without a prefill pool; `seed` seeds the
    random choices (None: a fresh seed).

    Raises:
        ValueError: an unknown name, or one a colocated deployment cannot use.
    """
    if colocated:
        return ColocatedPolicy(name, seed)
    policies: dict[str, Policy] = {
        "random": RandomPolicy(seed), "round_robin": RoundRobinPolicy(), "least_loaded": LeastLoadedPolicy(),
        "local_cache_aware": LocalCacheAwarePolicy(),
        "conductor": ConductorPolicy(local_prefill_tokens, tbt_slo_s),
    }
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(policies)}")
    return policies[name]
