"""The studies beyond the main sweep (issue 20, 4a-4f): the runs each plans (settings, pools, loads), that they stay
out of the main sweep's figures, and the JSON keys their figures come under."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadgen.record import RequestRecord
from shared.sim.profiles import get_profile
from shared.tools.experiment.mooncake import ExperimentConfig, RunOutcome, plan_runs
from shared.tools.experiment.results import compute, to_json
from shared.tools.experiment.studies import (
    GLOBAL_LOCAL_POOLS,
    PD_SPLITS,
    POOL_TOKENS,
    REJECTION_TIME_SCALE,
    STUDIES,
    kv_codec_bytes_ratio,
    plan_studies,
    pool_mb_per_shard,
)

SCALES = (2.0, 1.0)


def config(tmp_path: Path, clock: str = "virtual") -> ExperimentConfig:
    return ExperimentConfig(trace=tmp_path / "conversation_trace.jsonl.gz", log_dir=tmp_path, time_scales=SCALES,
                            policy_time_scale=1.0,
                            policies=("random", "conductor"), num_prefill=8, num_decode=8, num_cache_stores=16,
                            clock=clock, studies=STUDIES)


def test_each_study_plans_its_runs(tmp_path: Path) -> None:
    runs = plan_studies(config(tmp_path))
    by_study = {name: [r for r in runs if r.study == name] for name in STUDIES}
    plain = [r for r in by_study["baselines"] if r.variant == "plain"]
    assert [r.time_scale for r in plain] == list(SCALES) and all(r.system == "baseline" for r in plain)
    assert dict(plain[0].env) == {"TSUKIMI_PREFIX_CACHING": "off", "TSUKIMI_MAX_BATCHED_TOKENS": "131072"}
    assert len(by_study["baselines"]) == 3 * len(SCALES)
    pool = {r.variant: r for r in by_study["pool"]}
    assert list(pool) == [*map(str, POOL_TOKENS), "global", "local"]
    assert dict(pool["1000000"].env)["TSUKIMI_CACHE_DRAM_MB"] == "19531"  # 1M x 327,680 B over 16 shards
    assert pool["global"].pools == pool["local"].pools == GLOBAL_LOCAL_POOLS
    local = dict(pool["local"].env)
    assert pool["local"].max_output_tokens == pool["global"].max_output_tokens == 1  # the paper's
    assert local["TSUKIMI_CACHE_DRAM_MB"] == "1" and local["TSUKIMI_SIM_KV_TOKENS"] == "3000000"
    assert "TSUKIMI_SIM_KV_TOKENS" not in dict(pool["global"].env)
    assert [r.pools for r in by_study["pd_split"]] == list(PD_SPLITS) and PD_SPLITS[0] == (5, 11)
    assert [(r.variant, r.time_scale) for r in by_study["rejection"]] == [
        (mode, REJECTION_TIME_SCALE) for mode in ("off", "current", "predicted")]
    codecs = [dict(r.env)["TSUKIMI_SIM_KV_CODEC"] for r in by_study["kv_codec"]]
    assert codecs == ["none"] * len(SCALES) + ["kvquant-3"] * len(SCALES)


def test_studies_run_on_the_virtual_clock_only(tmp_path: Path) -> None:
    assert not any(r.study for r in plan_runs(config(tmp_path, clock="wall")))
    assert sum(bool(r.study) for r in plan_runs(config(tmp_path))) == len(plan_studies(config(tmp_path)))


def test_a_pool_size_is_spread_over_the_shards() -> None:
    cfg = ExperimentConfig(trace=Path("t"), log_dir=Path("l"))
    per_token = get_profile(cfg.profile).kv_bytes_per_token
    assert pool_mb_per_shard(cfg, 3_000_000, 4) == round(3_000_000 * per_token / 4 / (1 << 20))
    assert pool_mb_per_shard(cfg, 1, 16) == 1  # never below 1 MiB
    assert kv_codec_bytes_ratio(cfg.profile) == pytest.approx(5.01, abs=0.01)  # issue 20's 4f figure


def record(index: int, ttft_s: float | None) -> RequestRecord:
    r = RequestRecord(index, 0.0, 100, 3)
    r.send_s = 0.0
    if ttft_s is None:
        r.status, r.error, r.done_s = 429, "overloaded", 0.0
    else:
        r.status, r.chunk_times_s, r.done_s = 200, [ttft_s, ttft_s + 0.02, ttft_s + 0.04], ttft_s + 0.04
        r.num_prompt_tokens, r.num_output_tokens = 100, 3
    return r


def test_study_runs_stay_out_of_the_main_figures_and_give_their_keys(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    main = [RunOutcome("baseline", "least_loaded", 1.0, 1.0, [record(0, 1.0)]),
            RunOutcome("tsukimi", "conductor", 1.0, 1.0, [record(0, 2.0)])]
    rejection = [RunOutcome("tsukimi", "conductor", 0.5, 2.0, [record(0, 1.0), record(1, None)], study="rejection",
                            variant=mode, load_over_time={"t_s": [10.0]}) for mode in ("off", "predicted")]
    pd = [RunOutcome("tsukimi", "conductor", 1.0, 1.0, [record(0, 9.0)], study="pd_split", variant="5P11D")]
    results = compute(cfg, main + rejection + pd)
    assert results.avg_ttft_s == {"conductor": pytest.approx(2.0)}  # not the 5P11D run's 9 s
    out = to_json(results)
    assert out["rejections"]["predicted"]["rejected"] == 1 and out["rejections"]["off"]["completed"] == 1
    assert out["load_over_time"]["off"] == {"t_s": [10.0]}
    assert out["pd_sweep"]["5P11D"]["avg_ttft_s"] == pytest.approx(9.0)
    assert "kv_codec" not in out and out["paper"]["rejections"]["predicted"] == 3589
