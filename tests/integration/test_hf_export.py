"""A model exported as a Hugging Face folder (for peers that read only that format) is the model tsukimi serves:
transformers loads it and decodes greedily the tokens tsukimi's engine decodes, with the same tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.model.checkpoint import load_checkpoint
from shared.tools.hf_export import export_hf_folder
from shared.wire.protocol import SamplingParams

pytestmark = pytest.mark.slow


def test_transformers_decodes_the_exported_folder_as_tsukimi_does(tmp_path: Path) -> None:
    import transformers

    checkpoint = load_checkpoint(None)
    folder = export_hf_folder(checkpoint, tmp_path / "hf", torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = "Write one sentence about the sea:"
    ids = checkpoint.tokenizer.encode(text)
    assert tokenizer(text)["input_ids"] == ids
    theirs = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="fp32", kv_cache_bytes=32 << 20))
    ours = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    assert theirs == ours
    with pytest.raises(ValueError, match="dummy"):
        export_hf_folder(load_checkpoint("dummy:tiny"), tmp_path / "none")
