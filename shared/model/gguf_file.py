"""Reading a llama.cpp GGUF file into a LlamaConfig and a float32 state dict under Hugging Face Llama names.

Owns dequantization (via the `gguf` package) and the un-permutation of Q/K rows; the header is `gguf_header`'s, and
the tokenizer is built from its metadata by `tokenizer.py`.
"""

from __future__ import annotations

import mmap
import os
import re
from concurrent.futures import ThreadPoolExecutor
from math import prod
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from shared.model.config import LlamaConfig
from shared.model.gguf_header import GGUFTensorInfo, llama_config, mapped_gguf

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """Load a Llama-architecture GGUF file, dequantizing every tensor to float32.

    Returns:
        `(config, state_dict, metadata)`: the state dict uses Hugging Face `LlamaForCausalLM` names, with
        Q/K rows in HF (rotate_half) order; `lm_head.weight` is present only when the file has
        `output.weight`. `metadata` is the file's key/values, which `Tokenizer.from_gguf_metadata` reads.
    Raises:
        ValueError: not a GGUF file, not `general.architecture == "llama"`, a tensor this loader does not
            know (e.g. `rope_freqs.weight`), a type `gguf` cannot dequantize, or missing hyper-parameters.
    """
    with mapped_gguf(Path(path)) as (buf, metadata, infos):
        config = llama_config(metadata, {info.name: info for info in infos})
        hf_names = [_hf_name(info.name) for info in infos]
        # numpy releases the GIL while dequantizing, so tensors load in parallel.
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            tensors = list(pool.map(lambda info: _load_tensor(buf, info, config), infos))
    return config, dict(zip(hf_names, tensors, strict=True)), metadata


def _load_tensor(buf: mmap.mmap, info: GGUFTensorInfo, config: LlamaConfig) -> torch.Tensor:
    if info.offset + info.nbytes > len(buf):
        raise ValueError(f"tensor {info.name!r} runs past the end of the file")
    rows = prod(info.shape[:-1])
    raw = np.frombuffer(buf, np.uint8, count=info.nbytes, offset=info.offset).reshape(rows, -1)
    try:
        values = gguf.quants.dequantize(raw, info.ggml_type)  # [rows, shape[-1]]
    except NotImplementedError as exc:
        raise ValueError(f"tensor {info.name!r}: cannot dequantize {info.ggml_type.name}") from exc
    # F32 comes back as a read-only view of the mapping: copy it so nothing outlives the file.
    values = values.astype(np.float32, copy=not values.flags.writeable)
    weight = torch.from_numpy(values).reshape(info.shape)
    if info.name.endswith(".attn_q.weight"):
        return _unpermute_rope_rows(weight, config.num_heads)
    if info.name.endswith(".attn_k.weight"):
        return _unpermute_rope_rows(weight, config.num_kv_heads)
    return weight


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permute(): per head, rows are stored (x0, y0, x1, y1, ...) for interleaved RoPE;
    HF's rotate_half wants (x0, x1, ..., y0, y1, ...)."""
    gguf_rows = torch.arange(weight.shape[0]).reshape(num_heads, -1, 2)  # [num_heads, head_dim / 2, 2]
    return weight.index_select(0, gguf_rows.transpose(1, 2).reshape(-1))


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no place in a plain Llama model")
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.weight"
