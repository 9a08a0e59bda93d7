"""A loaded model (config, float32 weights, tokenizer, fingerprint) from a GGUF file or a Hugging Face folder: the
manifest (`manifest`: where the default model lives, the tokenizer, the fingerprint) and the weights. Nothing is
downloaded or cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model.config import LlamaConfig
from shared.model.dummy import is_dummy
from shared.model.gguf_file import read_gguf
from shared.model.manifest import read_manifest
from shared.model.safetensors_folder import read_state_dict
from shared.model.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    """Everything needed to run a model.

    Attributes:
        config: the architecture.
        state_dict: float32 tensors under Hugging Face `LlamaForCausalLM` names; no `lm_head.weight` when
            `config.tie_word_embeddings`.
        tokenizer: the model's tokenizer and chat template.
        fingerprint: 16 hex digits identifying the weights (`manifest.fingerprint`); namespaces KV block hashes.
        path: the .gguf file or the Hugging Face folder it was loaded from (a dummy's: its shape's file).
        is_dummy: no weights (`state_dict` is empty): the model gets random ones (`shared.model.dummy`).
    """

    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    fingerprint: str
    path: Path
    is_dummy: bool = False


def load_checkpoint(path: str | Path | None = None) -> Checkpoint:
    """Load a `.gguf` file or a Hugging Face Llama folder (config.json + *.safetensors + tokenizer.json): its
    manifest (`read_manifest`), then its weights as float32.

    Args:
        path: the file or folder; None loads `default_model_path()`; `dummy:NAME` loads no weights (`is_dummy`).
    Raises:
        FileNotFoundError: nothing at `path`, a folder without config.json, or missing weight/tokenizer files.
        ValueError: a file that is not .gguf, an unsupported architecture, or weights whose names or shapes
            do not fit the config.
    """
    manifest = read_manifest(path)
    config = manifest.config
    if is_dummy(path):
        return Checkpoint(config, {}, manifest.tokenizer, manifest.fingerprint, manifest.path, is_dummy=True)
    if manifest.path.is_file():
        _, state_dict, _ = read_gguf(manifest.path)
    else:
        state_dict = read_state_dict(manifest.path, config.tie_word_embeddings, torch.float32)
    check_state_dict(config, state_dict)
    return Checkpoint(config, state_dict, manifest.tokenizer, manifest.fingerprint, manifest.path)


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama state dict must hold for `config`, with its shape, under HF names."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def check_state_dict(config: LlamaConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the missing, unexpected and misshapen tensors, if any."""
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    misshapen = [
        f"{name} {tuple(state_dict[name].shape)} != {shape}"
        for name, shape in expected.items()
        if name in state_dict and tuple(state_dict[name].shape) != shape
    ]
    problems = [
        f"{label}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen))
        if items
    ]
    if problems:
        raise ValueError("weights do not fit the config; " + "; ".join(problems))
