"""Loading Hugging Face Llama folders (single-file and sharded safetensors), and load_checkpoint's errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from shared.model.checkpoint import expected_shapes, load_checkpoint
from shared.model.config import LlamaConfig
from shared.model.gguf_header import read_gguf_metadata
from shared.model.manifest import default_model_path, read_manifest
from shared.model.tokenizer import Tokenizer

TINY = LlamaConfig(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position=256,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def gguf_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))


def write_tokenizer(folder: Path, tokenizer: Tokenizer) -> None:
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    settings = {
        "chat_template": tokenizer.chat_template,
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "add_bos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def write_folder(
    folder: Path, config: LlamaConfig, state_dict: dict[str, torch.Tensor], shards: int = 1
) -> None:
    """A folder as transformers 5 writes it: rope_theta under rope_parameters, optional sharding."""
    raw = {
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default"},
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_word_embeddings,
    }
    (folder / "config.json").write_text(json.dumps(raw))
    names = sorted(state_dict)
    groups = [names[i::shards] for i in range(shards)]
    if shards == 1:
        save_file({n: state_dict[n] for n in names}, folder / "model.safetensors")
        return
    weight_map = {}
    for index, group in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: state_dict[n].contiguous() for n in group}, folder / file)
        weight_map |= dict.fromkeys(group, file)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def random_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in expected_shapes(config).items()}


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tied", [True, False])
def test_folder_round_trips(tmp_path: Path, gguf_tokenizer: Tokenizer, shards: int, tied: bool) -> None:
    config = LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": tied})
    state_dict = random_state_dict(config)
    write_folder(tmp_path, config, {k: v.to(torch.bfloat16) for k, v in state_dict.items()}, shards)
    write_tokenizer(tmp_path, gguf_tokenizer)
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.config == config and checkpoint.path == tmp_path
    assert checkpoint.state_dict.keys() == state_dict.keys()
    for name, tensor in checkpoint.state_dict.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state_dict[name].to(torch.bfloat16).float()), name


def test_folder_tokenizer_matches_gguf_tokenizer(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    write_folder(tmp_path, TINY, random_state_dict(TINY))
    write_tokenizer(tmp_path, gguf_tokenizer)
    tokenizer = load_checkpoint(tmp_path).tokenizer
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,) and not tokenizer.add_bos_token
    assert tokenizer.control_token_ids == gguf_tokenizer.control_token_ids
    chat = [{"role": "user", "content": "Bonjour 😀"}]
    assert tokenizer.apply_chat_template(chat) == gguf_tokenizer.apply_chat_template(chat)
    assert tokenizer.encode_chat(chat) == gguf_tokenizer.encode_chat(chat)


def test_tied_lm_head_in_the_file_is_dropped(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    state_dict = random_state_dict(TINY)
    write_folder(
        tmp_path, TINY, {**state_dict, "lm_head.weight": state_dict["model.embed_tokens.weight"].clone()}
    )
    write_tokenizer(tmp_path, gguf_tokenizer)
    assert load_checkpoint(tmp_path).state_dict.keys() == state_dict.keys()


def test_the_fingerprint_is_of_the_stored_bytes_and_sees_weight_changes(
    tmp_path: Path, gguf_tokenizer: Tokenizer
) -> None:
    """Read from the files without loading them: the same weights in another folder (or sharded otherwise) give
    the same fingerprint, a changed weight or architecture another; the checkpoint carries the manifest's."""
    state_dict = random_state_dict(TINY)
    folders = {name: tmp_path / name for name in ("one", "copy", "changed", "rope")}
    for folder in folders.values():
        folder.mkdir()
    write_folder(folders["one"], TINY, state_dict)
    write_folder(folders["copy"], TINY, {k: v.clone() for k, v in state_dict.items()})
    write_folder(folders["changed"], TINY, {**state_dict, "model.norm.weight": state_dict["model.norm.weight"] + 1e-3})
    write_folder(folders["rope"], LlamaConfig(**{**TINY.__dict__, "rope_theta": 1e4}), state_dict)
    for folder in folders.values():
        write_tokenizer(folder, gguf_tokenizer)
    prints = {name: read_manifest(folder).fingerprint for name, folder in folders.items()}
    assert len(prints["one"]) == 16 and int(prints["one"], 16) >= 0
    assert prints["copy"] == prints["one"] and prints["changed"] != prints["one"] and prints["rope"] != prints["one"]
    assert load_checkpoint(folders["one"]).fingerprint == prints["one"]


def test_the_default_models_manifest_needs_no_torch_and_matches_its_checkpoint() -> None:
    manifest = read_manifest()
    assert manifest.config.vocab_size == 49152 and manifest.config.max_position == 8192
    assert manifest.tokenizer.encode("Hello") == load_checkpoint().tokenizer.encode("Hello")
    assert load_checkpoint().fingerprint == manifest.fingerprint == read_manifest(default_model_path()).fingerprint


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no model at .*nowhere"):
        load_checkpoint(tmp_path / "nowhere")


def test_folder_without_config_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="without config.json"):
        load_checkpoint(tmp_path)


def test_other_files_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_checkpoint(tmp_path / "weights.bin")
    (tmp_path / "fake.gguf").write_bytes(b"GGML" + b"\0" * 60)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(tmp_path / "fake.gguf")


def test_incomplete_folders_are_clear_errors(tmp_path: Path, gguf_tokenizer: Tokenizer) -> None:
    state_dict = random_state_dict(TINY)
    del state_dict["model.layers.1.mlp.up_proj.weight"]
    write_folder(tmp_path, TINY, state_dict)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_checkpoint(tmp_path)
    write_tokenizer(tmp_path, gguf_tokenizer)
    with pytest.raises(ValueError, match="missing: model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "qwen2"}))
    with pytest.raises(ValueError, match="model_type 'qwen2'"):
        load_checkpoint(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_folder_written_by_transformers(tmp_path: Path, gguf_tokenizer: Tokenizer, tied: bool) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    hf_config = transformers.LlamaConfig(
        vocab_size=TINY.vocab_size,
        hidden_size=TINY.hidden_size,
        intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads,
        rope_theta=TINY.rope_theta,
        rms_norm_eps=TINY.rms_norm_eps,
        max_position_embeddings=TINY.max_position,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config)
    model.save_pretrained(tmp_path, max_shard_size="1MB")
    write_tokenizer(tmp_path, gguf_tokenizer)
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.config == LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": tied})
    reference = model.state_dict()
    assert checkpoint.state_dict.keys() == reference.keys() - ({"lm_head.weight"} if tied else set())
    for name, tensor in checkpoint.state_dict.items():
        assert torch.equal(tensor, reference[name]), name
