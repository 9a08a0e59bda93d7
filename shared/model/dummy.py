"""Models with random weights at a named model's shape (vLLM's `--load-format dummy`), to measure the engine and the
services at a size whose weights are not on this machine, as the Mooncake paper's experiments did with a dummy
Llama-2 70B. A model reference `dummy:NAME` names a shape shipped as data (`shapes/NAME.json`, a Hugging Face
config.json's keys) or, as `dummy:PATH`, the architecture of a GGUF file or Hugging Face folder. The tokenizer is a
folder's own (tokenizer.json) where it has one, else the default model's; the fingerprint names the shape, so no
block of a dummy model is taken for a real one's. No torch here (the gateway reads it); the weights are
`llama.build_dummy_model`'s.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shared.model.config import LlamaConfig
from shared.model.gguf_header import read_gguf_metadata
from shared.model.hf_folder import llama_config_from_json, read_folder_config, read_tokenizer
from shared.model.tokenizer import Tokenizer

DUMMY_PREFIX = "dummy:"
SHAPES_DIR = Path(__file__).resolve().parent / "shapes"


def is_dummy(ref: str | Path | None) -> bool:
    """Does the model reference ask for random weights (`dummy:NAME` or `dummy:PATH`)?"""
    return isinstance(ref, str) and ref.startswith(DUMMY_PREFIX)


def shape_names() -> list[str]:
    """The shapes shipped with tsukimi (`dummy:NAME`)."""
    return sorted(path.stem for path in SHAPES_DIR.glob("*.json"))


def dummy_manifest_parts(ref: str) -> tuple[LlamaConfig, Tokenizer, str, Path]:
    """The architecture, tokenizer, fingerprint and source file of `dummy:NAME` or `dummy:PATH`.

    Raises:
        ValueError: not a dummy reference, or an unknown shape name (the message lists the shipped ones).
        FileNotFoundError: a PATH with nothing there.
    """
    from shared.model.manifest import default_model_path, read_manifest  # the manifest reads dummies through here

    if not is_dummy(ref):
        raise ValueError(f"{ref!r} is not a dummy model reference ({DUMMY_PREFIX}NAME or {DUMMY_PREFIX}PATH)")
    name = ref[len(DUMMY_PREFIX):]
    shape = SHAPES_DIR / f"{name}.json"
    if shape.is_file():
        config, source = llama_config_from_json(json.loads(shape.read_text())), shape
    elif (Path(name).expanduser() / "config.json").is_file():  # a folder's architecture, weights or none
        source = Path(name).expanduser()
        config = read_folder_config(source)
    elif "/" in name or name.endswith(".gguf") or Path(name).expanduser().exists():
        manifest = read_manifest(name)
        config, source = manifest.config, manifest.path
    else:
        raise ValueError(f"no model shape {name!r}: {DUMMY_PREFIX}NAME takes one of {', '.join(shape_names())}, or "
                         f"{DUMMY_PREFIX}PATH a GGUF file or a Hugging Face folder whose architecture to use")
    if source.is_dir() and (source / "tokenizer.json").is_file():
        tokenizer = read_tokenizer(source)
    else:
        tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    fingerprint = hashlib.blake2b(f"dummy:{config}".encode(), digest_size=8).hexdigest()
    return config, tokenizer, fingerprint, source
