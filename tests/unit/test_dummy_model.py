"""Models of random weights at a shipped shape (`dummy:NAME`) or a real model's (`dummy:PATH`): their manifest, the
engine over them, a vocabulary larger than the tokenizer's, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.checkpoint import load_checkpoint
from shared.model.dummy import SHAPES_DIR, shape_names
from shared.model.manifest import default_model_path, read_manifest
from shared.wire.protocol import SamplingParams


def test_every_shipped_shape_reads_as_a_llama() -> None:
    assert {"llama-3-8b", "llama-3-70b", "tiny"} <= set(shape_names())
    eight = read_manifest("dummy:llama-3-8b").config
    assert (eight.num_layers, eight.hidden_size, eight.num_kv_heads, eight.vocab_size) == (32, 4096, 8, 128256)
    assert 7.9e9 < eight.num_parameters < 8.1e9  # Llama 3 8B
    assert 70e9 < read_manifest("dummy:llama-3-70b").config.num_parameters < 71e9


def test_a_dummy_is_namespaced_apart_from_the_real_model_of_its_shape() -> None:
    real = read_manifest(None)
    shaped = read_manifest(f"dummy:{default_model_path()}")
    assert shaped.config == real.config and shaped.fingerprint != real.fingerprint
    assert read_manifest("dummy:tiny").fingerprint != read_manifest("dummy:llama-3-8b").fingerprint
    assert load_checkpoint("dummy:tiny").is_dummy and load_checkpoint("dummy:tiny").state_dict == {}


@pytest.mark.parametrize("ref", ["dummy:nope", "dummy:/no/such/folder"])
def test_an_unknown_shape_or_path_is_refused_with_the_choices(ref: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="llama-3-8b|no model at"):
        read_manifest(ref)


def test_a_vocabulary_larger_than_the_tokenizer_never_samples_an_undecodable_id(tmp_path: Path) -> None:
    shape = json.loads((SHAPES_DIR / "tiny.json").read_text()) | {"vocab_size": 60000, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(shape))
    engine = LLMEngine.from_path(f"dummy:{tmp_path}", EngineConfig(device="cpu", dtype="fp32", kv_cache_bytes=4 << 20))
    assert engine.model_config.vocab_size == 60000 and engine.tokenizer.vocab_size == 49152
    params = SamplingParams(max_tokens=64, temperature=5.0, seed=3, ignore_eos=True)
    (out,) = engine.generate([list(range(100, 140))], params)
    assert len(out.token_ids) == 64 and max(out.token_ids) < 49152


def test_the_engine_runs_a_dummy_in_bf16_with_finite_logits() -> None:
    engine = LLMEngine.from_path("dummy:tiny", EngineConfig(device="cpu", dtype="bf16", kv_cache_bytes=4 << 20))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first, again = (engine.generate([list(range(200, 260))], params)[0] for _ in range(2))
    assert len(first.token_ids) == 8 and first.token_ids == again.token_ids
    model = engine.runner.model  # type: ignore[attr-defined]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
