"""Each default is declared once, in `shared.env_vars`: a service, the engine's and FastGen's dataclasses and the
CLI's flags all start from the same values (they once differed: a 512 MiB KV pool for services, 1 GiB for the CLI)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from shared.config import load_settings
from shared.engine.config import AUTO_KV_CACHE_BYTES, EngineConfig
from shared.engine.kv.fastgen.kv import DEFAULT_PROFILE_ROWS
from shared.env_vars import ENV_VARS, PREFILL_BATCHED_TOKENS, default, default_int
from shared.fastgen.policies import FastGenSettings
from shared.tools.cli.common import add_engine_args, engine_config_from_args


def test_a_service_without_variables_gets_the_dataclasses_defaults() -> None:
    engine = load_settings("decode", {}).engine
    assert engine.fastgen.profile_rows == DEFAULT_PROFILE_ROWS  # what the engine profiles on when given None
    assert replace(engine, fastgen=replace(engine.fastgen, profile_rows=None)) == EngineConfig()
    assert EngineConfig().fastgen == FastGenSettings()


def test_a_prefill_instance_runs_larger_steps_unless_told() -> None:
    assert load_settings("prefill", {}).engine.max_num_batched_tokens == PREFILL_BATCHED_TOKENS
    assert PREFILL_BATCHED_TOKENS != default_int("TSUKIMI_MAX_BATCHED_TOKENS")
    told = {"TSUKIMI_MAX_BATCHED_TOKENS": "768"}
    assert load_settings("prefill", told).engine.max_num_batched_tokens == 768
    assert load_settings("decode", told).engine.max_num_batched_tokens == 768


def test_the_clis_engine_flags_default_to_the_same_engine() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()


def test_defaults_are_the_tables() -> None:
    config = EngineConfig()
    assert default("TSUKIMI_KV_CACHE_MB") == "auto" and config.kv_cache_bytes == AUTO_KV_CACHE_BYTES
    assert config.kv_memory_fraction == float(default("TSUKIMI_KV_MEMORY_FRACTION"))
    assert config.block_size == default_int("TSUKIMI_BLOCK_SIZE")
    assert config.max_num_batched_tokens == default_int("TSUKIMI_MAX_BATCHED_TOKENS")
    assert DEFAULT_PROFILE_ROWS == default_int("TSUKIMI_FASTGEN_PROFILE_ROWS")
    assert all(name.startswith("TSUKIMI_") and var.help for name, var in ENV_VARS.items())
