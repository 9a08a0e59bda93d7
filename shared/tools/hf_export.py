"""A model as a Hugging Face Llama folder (config.json, model.safetensors, tokenizer.json, tokenizer_config.json), so
that peers that read only that format (vLLM, transformers) serve the very weights tsukimi serves. It writes; loading
is `shared.model`'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.model.checkpoint import Checkpoint
from shared.model.config import LlamaConfig
from shared.model.tokenizer import Tokenizer


def export_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json (BOS, EOS, whether BOS is added, the chat template)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    settings = {"bos_token": _token(tokenizer, tokenizer.bos_token_id),
                "eos_token": _token(tokenizer, tokenizer.eos_token_ids[0]),
                "add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))


def hf_config(config: LlamaConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, object]:
    """config.json of a `LlamaForCausalLM` with `config`'s architecture."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": list(tokenizer.eos_token_ids),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_hf_folder(checkpoint: Checkpoint, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `checkpoint` (its weights as loaded: a GGUF's dequantized) into `folder` in `dtype`; returns `folder`.

    Raises:
        ValueError: a checkpoint without weights (a dummy).
    """
    if checkpoint.is_dummy:
        raise ValueError("a dummy model has no weights to export")
    folder.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.to(dtype).contiguous() for name, tensor in checkpoint.state_dict.items()}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(checkpoint.config, checkpoint.tokenizer, dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    export_tokenizer(checkpoint.tokenizer, folder)
    return folder


def _token(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.backend.id_to_token(token_id)
