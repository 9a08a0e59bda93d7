"""Reading a local Hugging Face Llama folder's weights: *.safetensors (one file or sharded; which files is
`hf_folder`'s). checkpoint.py checks the state dict's names and shapes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.model.hf_folder import weight_files

_DROPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed by the model


def read_state_dict(folder: Path, tie_word_embeddings: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (`hf_folder.weight_files`) as `dtype`.

    Raises:
        FileNotFoundError: no safetensors file, or a shard the index names is missing.
    """
    state_dict: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        for key, tensor in load_file(path).items():
            if key.endswith(_DROPPED_SUFFIXES) or (tie_word_embeddings and key == "lm_head.weight"):
                continue
            state_dict[key] = tensor.to(dtype)
    return state_dict
