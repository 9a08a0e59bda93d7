"""A local Hugging Face Llama folder without its weights: the architecture (config.json), the tokenizer
(tokenizer.json, tokenizer_config.json, chat_template.jinja) and which safetensors files hold the weights. No torch:
the gateway and the scheduler read a model through it (`manifest`); `safetensors_folder` loads the weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from shared.model.config import LlamaConfig
from shared.model.tokenizer import Tokenizer

_INDEX = "model.safetensors.index.json"


def read_folder_config(folder: Path) -> LlamaConfig:
    """The architecture of config.json. Raises FileNotFoundError (none) or ValueError (see `llama_config_from_json`)."""
    return llama_config_from_json(_read_json(folder / "config.json", required=True))


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the index's shards, else every *.safetensors, sorted.

    Raises:
        FileNotFoundError: no safetensors file, or a shard the index names is missing.
    """
    index = folder / _INDEX
    if index.is_file():
        names = sorted(set(_read_json(index, required=True)["weight_map"].values()))
    else:
        names = sorted(path.name for path in folder.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    for name in names:
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is listed in {_INDEX} but missing")
    return [folder / name for name in names]


def llama_config_from_json(raw: Mapping[str, Any]) -> LlamaConfig:
    """A `LlamaConfig` from the dict of a Hugging Face config.json (transformers 4.x or 5.x keys).

    Raises:
        ValueError: not model_type "llama", attention/MLP biases, an activation other than SiLU, RoPE scaling.
    """
    if raw.get("model_type") != "llama":
        raise ValueError(f"config.json model_type {raw.get('model_type')!r} is not supported (only 'llama')")
    if raw.get("attention_bias") or raw.get("mlp_bias") or raw.get("hidden_act", "silu") != "silu":
        raise ValueError("only bias-free Llama models with SiLU activations are supported")
    rope = raw.get("rope_parameters") or {}  # transformers 5 moved rope_theta and the scaling here
    scaling = raw.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"RoPE scaling {scaling!r} is not supported")
    num_heads = int(raw["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def read_tokenizer(folder: Path) -> Tokenizer:
    """The folder's tokenizer: tokenizer.json, plus tokenizer_config.json / chat_template.jinja for the chat
    template, BOS/EOS and `add_bos_token`; EOS ids of generation_config.json and config.json are added.

    When `add_bos_token` is not stated it is read off tokenizer.json's post-processor (does it prepend BOS?).
    Raises:
        FileNotFoundError: no tokenizer.json (a SentencePiece tokenizer.model alone is not supported).
    """
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (tokenizer.model alone is not supported)")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    settings = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")
    bos = _token_id(backend, settings.get("bos_token"))
    bos = model_config.get("bos_token_id") if bos is None else bos
    eos = [_token_id(backend, settings.get("eos_token"))]
    eos += _id_list(generation.get("eos_token_id")) + _id_list(model_config.get("eos_token_id"))
    add_bos = settings.get("add_bos_token")
    if add_bos is None:
        add_bos = bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
    return Tokenizer(
        backend,
        chat_template=_chat_template(folder, settings),
        bos_token_id=bos,
        eos_token_ids=[i for i in eos if i is not None],
        add_bos_token=bool(add_bos),
    )


def _chat_template(folder: Path, settings: Mapping[str, Any]) -> str | None:
    """transformers >= 4.47 saves the template as chat_template.jinja; older ones inside tokenizer_config."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one is the chat template
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _token_id(backend: Backend, token: str | Mapping[str, Any] | None) -> int | None:
    if isinstance(token, Mapping):  # a serialized AddedToken
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _read_json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} not found")
        return {}
    with open(path, encoding="utf-8") as file:
        return json.load(file)
