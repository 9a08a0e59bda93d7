"""The Hugging Face transformers baseline for `tsukimi bench engine`: load the GGUF model densely and offline,
build the random prompts both sides share, time `generate`'s prefill and decode. Knows nothing of tsukimi."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_ID_MARGIN = 100  # keep prompts clear of special tokens at the low end and of the vocabulary's tail
_WARMUP_PROMPT_LEN = 8


def random_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`batch_size` prompts of `prompt_len` token ids, uniform in [100, vocab_size - 100), from `seed`.

    Both sides of `tsukimi bench engine` call this, so they run the very same prompts.

    Raises:
        ValueError: vocab_size leaves no ids between the margins.
    """
    if vocab_size <= 2 * _ID_MARGIN:
        raise ValueError(f"vocab_size must exceed {2 * _ID_MARGIN}; got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(_ID_MARGIN, vocab_size - _ID_MARGIN, (batch_size, prompt_len), generator=generator)
    return ids.tolist()


def load_transformers_model(gguf_path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The GGUF checkpoint as a transformers causal LM in `dtype`, in eval mode, loaded without the network.

    Every weight is dequantized at load time (`GgufConfig(dequantize=True)`), so the baseline runs dense
    matmuls in `dtype` whether or not a packed-GGUF matmul kernel happens to be installed.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        dtype=dtype,
        local_files_only=True,
        quantization_config=GgufConfig(dequantize=True),
    )
    return model.to(dtype).eval()


@dataclass(frozen=True)
class HFResult:
    """Throughput of transformers `generate` at one batch size; decode figures exclude prefill."""

    batch_size: int
    prefill_tok_s: float  # batch_size * prompt_len / prefill_s
    decode_tok_s: float  # batch_size / decode_step_s
    prefill_s: float  # generate with 1 new token: the prompt's forward pass and one sampled token
    decode_step_s: float  # (time of gen_len + 1 new tokens - prefill_s) / gen_len


def _time_generate(model: PreTrainedModel, input_ids: torch.Tensor, new_tokens: int) -> float:
    eos_token_id = model.generation_config.eos_token_id
    pad_token_id = model.generation_config.pad_token_id
    start = time.perf_counter()
    generate: Any = model.generate  # transformers' stubs type it as a Tensor attribute
    with torch.inference_mode():
        output = generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            use_cache=True,
            pad_token_id=pad_token_id if pad_token_id is not None else eos_token_id,
        )
    seconds = time.perf_counter() - start
    if output.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate made {output.shape[1] - input_ids.shape[1]} tokens, not {new_tokens}")
    return seconds


def measure_transformers(
    model: PreTrainedModel,
    batch_size: int,
    prompt_len: int,
    gen_len: int,
    seed: int = 0,
    repeats: int = 1,
) -> HFResult:
    """Prefill and decode throughput of greedy `generate` on `random_prompts(batch_size, prompt_len, ...)`.

    Prefill is the time to generate 1 new token; decode is the time to generate gen_len + 1 new tokens minus
    that, over gen_len steps. No padding (all prompts equal length), KV cache on, EOS cannot stop a run early,
    torch's thread count left as it is. One small warm-up generate runs first; with repeats > 1 the two
    timings alternate and each is the median of its runs.

    Raises:
        ValueError: a size or repeats below 1.
        RuntimeError: generate returned the wrong length, or decode timed at or below zero (noise).
    """
    if min(batch_size, prompt_len, gen_len, repeats) < 1:
        raise ValueError(f"sizes and repeats must be >= 1: {batch_size=} {prompt_len=} {gen_len=} {repeats=}")
    prompts = random_prompts(batch_size, prompt_len, model.config.vocab_size, seed)
    input_ids = torch.tensor(prompts, dtype=torch.long)  # [batch_size, prompt_len]
    _time_generate(model, input_ids[:1, :_WARMUP_PROMPT_LEN], 2)
    prefill_times, full_times = [], []
    for _ in range(repeats):
        prefill_times.append(_time_generate(model, input_ids, 1))
        full_times.append(_time_generate(model, input_ids, gen_len + 1))
    prefill_s = statistics.median(prefill_times)
    decode_s = statistics.median(full_times) - prefill_s
    if decode_s <= 0:
        raise RuntimeError(f"decode timed at {decode_s:.4f} s; the machine is too noisy to measure")
    return HFResult(
        batch_size=batch_size,
        prefill_tok_s=batch_size * prompt_len / prefill_s,
        decode_tok_s=batch_size * gen_len / decode_s,
        prefill_s=prefill_s,
        decode_step_s=decode_s / gen_len,
    )
