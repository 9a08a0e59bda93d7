"""The studies beyond the main sweep, on the virtual clock (issue 20, 4a-4f): the runs each plans and the figures
each gives. The main sweep (tsukimi against the colocated baseline over loads) and the policy comparison are
mooncake.py's; these add:

- baselines (FAST'25 Fig. 1/7): the capacity sweep against three more colocated baselines, vLLM's configurations
  (plain; prefix caching without chunking; chunked prefill without prefix caching); the main baseline has both.
- pool (Figs. 9-10 of FAST'25's cache study): the hit rate against the cache-store pool's size, and a global pool
  against local caches (10 prefill nodes of 3M tokens each, outputs of one token).
- pd_split (Fig. 15): 16 nodes split from 5P11D to 11P5D at the policy comparison's load.
- rejection (arXiv Table 3, Figs. 9-10): rejection off, on current load, predicted, at twice the trace's rate; the
  pools' load over time.
- kv_codec (what no peer measured): the capacity sweep with a pool too small for the trace, with blocks at bf16 and
  at kvquant-3's bytes in the pool and on every wire.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from loadgen.metrics import ttft_s
from shared.kvcompress.registry import codec_block_bytes
from shared.sim.profiles import get_profile
from shared.tools.experiment.capacity import capacity, capacity_ratio
from shared.tools.experiment.plan import BASELINE, TSUKIMI, PlannedRun

if TYPE_CHECKING:
    from shared.tools.experiment.mooncake import ExperimentConfig, RunOutcome

STUDIES = ("baselines", "pool", "pd_split", "rejection", "kv_codec")
MAIN_BASELINE = "chunked_prefill+prefix_caching"  # the main sweep's colocated instances (the sim's defaults)
# The whole pool's capacity, in tokens of bf16 KV: from a tenth of one node's DRAM to more than the whole trace's
# 92M distinct prompt tokens (1 TB of DRAM holds about 3M tokens of the 70B profile's KV).
POOL_TOKENS = (1_000_000, 3_000_000, 10_000_000, 30_000_000, 100_000_000)
# FAST'25's cache study: 10 prefill nodes, each with a local cache of 3M tokens, against one pool of their sum, outputs
# truncated to one token. Local: no pool, and each node's prefix cache holds 3M tokens (TSUKIMI_SIM_KV_TOKENS; a
# local DRAM cache's hit costs no transfer here, where the paper's loads it over PCIe).
GLOBAL_LOCAL_POOLS = (10, 6)
LOCAL_CACHE_TOKENS = 3_000_000
GLOBAL_POOL_TOKENS = GLOBAL_LOCAL_POOLS[0] * LOCAL_CACHE_TOKENS
GLOBAL_LOCAL_OUTPUT_TOKENS = 1
PD_SPLITS = tuple((p, 16 - p) for p in range(5, 12))
REJECTION_MODES = ("off", "current", "predicted")
REJECTION_TIME_SCALE = 0.5  # twice the trace's rate, as Table 3
KV_CODEC = "kvquant-3"
KV_CODEC_POOL_TOKENS = 3_000_000  # small enough that the trace's reusable prefixes do not all fit at bf16


def plan_studies(config: ExperimentConfig) -> list[PlannedRun]:
    """Every run of the studies `config.studies` names, in STUDIES order."""
    planners = {"baselines": _baselines, "pool": _pool, "pd_split": _pd_split, "rejection": _rejection,
                "kv_codec": _kv_codec}
    return [run for name in STUDIES if name in config.studies for run in planners[name](config)]


def _baselines(config: ExperimentConfig) -> Iterable[PlannedRun]:
    no_chunks = ("TSUKIMI_MAX_BATCHED_TOKENS", str(get_profile(config.profile).model.max_position))
    no_prefix_cache = ("TSUKIMI_PREFIX_CACHING", "off")
    variants = {"plain": (no_chunks, no_prefix_cache), "prefix_caching": (no_chunks,),
                "chunked_prefill": (no_prefix_cache,)}
    for name, env in variants.items():
        for scale in config.time_scales:
            yield PlannedRun(BASELINE, config.baseline_route, scale, "baselines", name, env)


def pool_mb_per_shard(config: ExperimentConfig, tokens: int, num_shards: int) -> int:
    """TSUKIMI_CACHE_DRAM_MB for a pool of `tokens` tokens of bf16 KV over `num_shards` shards (at least 1 MiB)."""
    return max(1, round(tokens * get_profile(config.profile).kv_bytes_per_token / num_shards / (1 << 20)))


def _pool(config: ExperimentConfig) -> Iterable[PlannedRun]:
    scale = config.policy_time_scale
    for tokens in POOL_TOKENS:
        mb = pool_mb_per_shard(config, tokens, config.num_cache_stores)
        yield PlannedRun(TSUKIMI, "conductor", scale, "pool", str(tokens), (("TSUKIMI_CACHE_DRAM_MB", str(mb)),))
    # Local: a pool of 1 MiB a shard holds no block (one is ~168 MB on the 70B profile), so what hits is each prefill
    # node's own prefix cache, grown to the paper's local DRAM cache.
    global_mb = pool_mb_per_shard(config, GLOBAL_POOL_TOKENS, config.num_cache_stores)
    local = (("TSUKIMI_CACHE_DRAM_MB", "1"), ("TSUKIMI_SIM_KV_TOKENS", str(LOCAL_CACHE_TOKENS)))
    for name, env in (("global", (("TSUKIMI_CACHE_DRAM_MB", str(global_mb)),)), ("local", local)):
        yield PlannedRun(TSUKIMI, "conductor", scale, "pool", name, env, GLOBAL_LOCAL_POOLS,
                         max_output_tokens=GLOBAL_LOCAL_OUTPUT_TOKENS)


def _pd_split(config: ExperimentConfig) -> Iterable[PlannedRun]:
    for prefill, decode in PD_SPLITS:
        yield PlannedRun(TSUKIMI, "conductor", config.policy_time_scale, "pd_split", f"{prefill}P{decode}D",
                         pools=(prefill, decode))


def _rejection(config: ExperimentConfig) -> Iterable[PlannedRun]:
    for mode in REJECTION_MODES:
        yield PlannedRun(TSUKIMI, "conductor", REJECTION_TIME_SCALE, "rejection", mode,
                         (("TSUKIMI_REJECTION", mode),))


def _kv_codec(config: ExperimentConfig) -> Iterable[PlannedRun]:
    mb = ("TSUKIMI_CACHE_DRAM_MB", str(pool_mb_per_shard(config, KV_CODEC_POOL_TOKENS, config.num_cache_stores)))
    for codec in ("none", KV_CODEC):
        for scale in config.time_scales:
            yield PlannedRun(TSUKIMI, "conductor", scale, "kv_codec", codec, (mb, ("TSUKIMI_SIM_KV_CODEC", codec)))


def kv_codec_bytes_ratio(profile_name: str, block_size: int = 512) -> float:
    """bf16 bytes of one layer's block over `KV_CODEC`'s (from the codec's own section sizes)."""
    model = get_profile(profile_name).model
    shape = (model.num_kv_heads, block_size, model.head_dim)  # fp16's bytes are bf16's: two a value
    return codec_block_bytes("fp16", *shape) / codec_block_bytes(KV_CODEC, *shape)


# ---- figures --------------------------------------------------------------------------------------------------


def study_figures(config: ExperimentConfig, runs: Sequence[RunOutcome]) -> dict[str, Any]:
    """The JSON keys of every study that ran (issue 20's names)."""
    by_study: dict[str, list[RunOutcome]] = {}
    for run in runs:
        if run.study and run.error is None:
            by_study.setdefault(run.study, []).append(run)
    main = [r for r in runs if not r.study and r.error is None]
    out: dict[str, Any] = {}
    if "baselines" in by_study:
        out["effective_capacity_ratio_by_baseline"] = _capacity_by_baseline(config, main, by_study["baselines"])
    if "pool" in by_study:
        pool = {r.variant: _hit_rate(r, config) for r in by_study["pool"]}
        out["hit_rate_by_capacity"] = {k: v for k, v in pool.items() if k.isdigit()}
        out["hit_rate_global"], out["hit_rate_local"] = pool.get("global"), pool.get("local")
    if "pd_split" in by_study:
        out["pd_sweep"] = {r.variant: _run_figures(r, config) for r in by_study["pd_split"]}
    if "rejection" in by_study:
        out["rejections"] = {r.variant: _run_figures(r, config) for r in by_study["rejection"]}
        out["load_over_time"] = {r.variant: r.load_over_time for r in by_study["rejection"]}
    if "kv_codec" in by_study:
        out["kv_codec"] = _kv_codec_figures(config, by_study["kv_codec"])
    return out


def _sweep_capacities(config: ExperimentConfig, runs: Sequence[RunOutcome]) -> dict[str, Any]:
    caps = {}
    for slo in config.slos():
        points = [(r.rate, r.summary(slo).effective_capacity or 0.0) for r in runs]
        if points:
            caps[f"{slo.tbt_ms:g}"] = capacity(points)
    return caps


def _capacity_by_baseline(config: ExperimentConfig, main: Sequence[RunOutcome],
                          baselines: Sequence[RunOutcome]) -> dict[str, dict[str, Any]]:
    ours = _sweep_capacities(config, [r for r in main if r.system == TSUKIMI and r.policy == "conductor"])
    groups = {MAIN_BASELINE: [r for r in main if r.system == BASELINE]}
    for run in baselines:
        groups.setdefault(run.variant, []).append(run)
    out = {}
    for name, group in groups.items():
        theirs = _sweep_capacities(config, group)
        ratios = {k: capacity_ratio(ours[k], theirs[k]) for k in theirs if k in ours}
        out[name] = {"ratio": {k: round(r.value, 3) for k, r in ratios.items()},
                     "bound": {k: r.bound for k, r in ratios.items()},
                     "capacity_req_s": {k: round(c.rate, 4) for k, c in theirs.items()}}
    return out


def _hit_rate(run: RunOutcome, config: ExperimentConfig) -> float | None:
    return run.summary(config.slos()[0]).cache_hit_rate


def _run_figures(run: RunOutcome, config: ExperimentConfig) -> dict[str, Any]:
    meeting = {f"{slo.tbt_ms:g}": run.summary(slo).num_meeting_slo for slo in config.slos()}
    first = run.summary(config.slos()[0])
    ttfts = [t for r in run.records if r.error is None and (t := ttft_s(r)) is not None]
    return {"completed": first.num_completed, "rejected": first.num_rejected, "failed": first.num_failed,
            "avg_ttft_s": round(sum(ttfts) / len(ttfts), 3) if ttfts else None,
            "tbt_p90_ms": first.tbt.p90_ms, "cache_hit_rate": first.cache_hit_rate, "meeting_slos": meeting,
            "goodput_req_s": {k: round(n / _span_s(run), 4) for k, n in meeting.items()}}


def _span_s(run: RunOutcome) -> float:
    return max((r.done_s or 0.0 for r in run.records), default=0.0) or 1.0


def _kv_codec_figures(config: ExperimentConfig, runs: Sequence[RunOutcome]) -> dict[str, Any]:
    caps = {codec: _sweep_capacities(config, [r for r in runs if r.variant == codec]) for codec in ("none", KV_CODEC)}
    at_policy_load = {r.variant: r for r in runs if r.time_scale == config.policy_time_scale}
    ratios = {k: capacity_ratio(caps[KV_CODEC][k], caps["none"][k]) for k in caps["none"] if k in caps[KV_CODEC]}
    return {"codec": KV_CODEC, "bytes_ratio": round(kv_codec_bytes_ratio(config.profile), 3),
            "pool_tokens_bf16": KV_CODEC_POOL_TOKENS,
            "hit_rate": {codec: _hit_rate(run, config) for codec, run in at_policy_load.items()},
            "capacity_req_s": {codec: {k: round(c.rate, 4) for k, c in by.items()} for codec, by in caps.items()},
            "capacity_bound": {codec: {k: c.bound for k, c in by.items()} for codec, by in caps.items()},
            "capacity_ratio": {k: round(r.value, 3) for k, r in ratios.items()},
            "capacity_ratio_bound": {k: r.bound for k, r in ratios.items()}}
