"""What a simulated model looks like to the control plane: a profile's architecture with no weights, a real
tokenizer, and a fingerprint and model id of its own. No torch (the gateway reads it)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from shared.model.gguf_header import read_gguf_metadata
from shared.model.manifest import ModelManifest, default_model_path
from shared.model.tokenizer import Tokenizer
from shared.sim.profiles import SimProfile


def sim_model_name(profile: SimProfile) -> str:
    """The model id the API serves under the sim backend: the profile's name, marked as simulated."""
    return f"{profile.name}-sim"


@functools.lru_cache(maxsize=8)
def sim_manifest(profile: SimProfile, tokenizer_path: str | None = None) -> ModelManifest:
    """The profile's architecture with no weights, and a real tokenizer (the default model's unless a GGUF is given),
    so prompts and streamed text work as usual. The fingerprint names the profile, so block hashes of a sim system
    never match a real model's. Made once per process and profile (a virtual cluster has dozens of engines; the
    tokenizer is read-only)."""
    path = Path(tokenizer_path) if tokenizer_path else default_model_path()
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    fingerprint = hashlib.blake2b(f"sim:{profile.name}".encode(), digest_size=8).hexdigest()
    return ModelManifest(profile.model, tokenizer, fingerprint, path)


def sim_kv_format(kv_format: str, sized_codec: str) -> str:
    """The KV format in the sim's block-hash namespace: a sized codec's blocks are other blocks, and the gateway,
    whose hashes the scheduler and the pool key blocks by, must name the same as the engine."""
    return kv_format if sized_codec == "none" else f"{kv_format}+{sized_codec}"
