"""Settings per role: each role reads and checks the variables it acts on; `tsukimi up` (role "up") checks them all;
an unknown `TSUKIMI_*` variable is an error for every role."""

from __future__ import annotations

import pytest

from shared.config import (
    CacheStoreSettings,
    ClusterSettings,
    ConfigError,
    EngineSettings,
    GatewaySettings,
    SchedulerSettings,
    load_settings,
)

ROLES = {"gateway": GatewaySettings, "scheduler": SchedulerSettings, "prefill": EngineSettings,
         "decode": EngineSettings, "cache-store": CacheStoreSettings, "up": ClusterSettings}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_each_role_gets_its_own_settings(role: str) -> None:
    settings = load_settings(role, {})
    assert type(settings) is ROLES[role]
    assert settings.instance_id.startswith(role) and settings.engine.block_size > 0


def test_a_role_is_not_refused_for_a_variable_only_another_role_reads() -> None:
    bad_policy = {"TSUKIMI_POLICY": "nearest"}
    with pytest.raises(ConfigError, match="TSUKIMI_POLICY"):
        load_settings("scheduler", bad_policy)
    with pytest.raises(ConfigError, match="TSUKIMI_POLICY"):
        load_settings("up", bad_policy)  # tsukimi up checks every role's before it starts one
    assert not hasattr(load_settings("cache-store", bad_policy), "policy")
    bad_shard = {"TSUKIMI_CACHE_SHARD": "3", "TSUKIMI_CACHE_SHARDS": "2"}
    with pytest.raises(ConfigError, match="TSUKIMI_CACHE_SHARD=3"):
        load_settings("cache-store", bad_shard)
    assert load_settings("gateway", bad_shard).port == 8000


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_role_refuses_an_unknown_variable_and_a_bad_shared_one(role: str) -> None:
    with pytest.raises(ConfigError, match="TSUKIMI_POLCY"):
        load_settings(role, {"TSUKIMI_POLCY": "conductor"})
    with pytest.raises(ConfigError, match="TSUKIMI_BLOCK_SIZE"):
        load_settings(role, {"TSUKIMI_BLOCK_SIZE": "many"})


def test_only_the_engines_hold_the_block_key_and_keep_it_out_of_their_logs() -> None:
    env = {"TSUKIMI_CACHE_BLOCK_KEY": "k" * 32, "TSUKIMI_NATS_PASSWORD": "p" * 16}
    prefill = load_settings("prefill", env)
    assert set(prefill.secrets()) == {"k" * 32, "p" * 16} and "k" * 32 not in repr(prefill)
    assert load_settings("scheduler", env).secrets() == ("p" * 16,)


def test_a_pipeline_group_names_two_or_more_distinct_instances() -> None:
    settings = load_settings("prefill", {"TSUKIMI_CPP_GROUP": " prefill-0, prefill-1 ", "TSUKIMI_CPP_MIN_TOKENS": "64"})
    assert isinstance(settings, EngineSettings)
    assert settings.cpp_group == ("prefill-0", "prefill-1") and settings.cpp_min_tokens == 64
    assert load_settings("prefill", {}).cpp_group == ()  # type: ignore[attr-defined]
    for bad in ("prefill-0", "prefill-0,prefill-0"):
        with pytest.raises(ConfigError, match="at least two distinct"):
            load_settings("prefill", {"TSUKIMI_CPP_GROUP": bad})
    with pytest.raises(ConfigError, match="TSUKIMI_CPP_MIN_TOKENS"):
        load_settings("prefill", {"TSUKIMI_CPP_MIN_TOKENS": "0"})
