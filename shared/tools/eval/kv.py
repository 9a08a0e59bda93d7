"""What `tsukimi eval kv` measures: a KV codec's perplexity, KL divergence and top-1 agreement against fp16 KV in the
same run, on windows of the evaluation span (never the calibration span), and its compression against fp16.

Owns the metrics; how attention sees the codec is `codec_attention`, the calibration/evaluation split `text_spans`,
the command line (and which calibration file) `shared/tools/cli/eval_kv`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shared.kvcompress.calibration import KvCalibration
from shared.kvcompress.codec import KvCodec
from shared.kvcompress.registry import layer_codecs
from shared.model.checkpoint import Checkpoint
from shared.model.llama import Llama, build_model
from shared.tools.eval.agreement import Agreement
from shared.tools.eval.codec_attention import DenseCodecAttention
from shared.tools.eval.text_spans import evaluation_span, windows

BASELINE_CODEC = "fp16"

Progress = Callable[[int, int], None]  # (window about to run, 1-based; number of windows)


def evaluate_codec(
    checkpoint: Checkpoint, codec_name: str, calibration: KvCalibration | None, tokens: Sequence[int], ctx: int,
    num_windows: int, block_size: int, progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the model (fp32, CPU) over `num_windows` windows of `ctx` tokens, once with the codec and once with fp16 KV.

    Each window is a sequence of its own (positions 0..ctx-1). A query sees the full blocks before its own block
    through the codec (block 0 as a sequence's first) and its own block exactly, as the engine does when decoding
    (`DenseCodecAttention`).

    Args:
        checkpoint: the model.
        codec_name: a name from `registry.CODEC_NAMES`.
        calibration: for a `kvquant-*` codec, else None.
        tokens: the whole text's tokens; only its evaluation span (`text_spans.evaluation_span`, after the
            calibration span) is evaluated, cut into consecutive non-overlapping windows.
        ctx, num_windows, block_size: tokens per window, windows wanted (fewer if the span holds fewer), tokens per
            KV block.
        progress: called with (window, number of windows) before each window.
    Returns:
        codec, ppl, ppl_fp16, rel_ppl_increase (ppl / ppl_fp16 - 1), kl (mean nats per prediction), top1_agreement,
        compression (fp16 bytes / codec bytes over every full block of every window), bits_per_element, codec_bytes,
        fp16_bytes, ctx, block_size, num_windows (run), num_predictions.
    Raises:
        ValueError: ctx below block_size or past the model's positions, an unknown codec.
        KvCalibrationError: a `kvquant-*` codec without a calibration, or one that does not fit the model.
        TextSpanError: the evaluation span holds less than one window.
    """
    config = checkpoint.config
    shape = (config.num_layers, config.num_kv_heads, config.head_dim)
    codecs, baseline = layer_codecs(codec_name, *shape, calibration), layer_codecs(BASELINE_CODEC, *shape)
    if not block_size <= ctx <= config.max_position:
        raise ValueError(f"ctx must be between the block size {block_size} and {config.max_position}, got {ctx}")
    spans = windows(evaluation_span(list(tokens)), ctx, num_windows)
    model = build_model(config, checkpoint.state_dict, torch.float32, torch.device("cpu"))
    codec_figures, fp16_figures = Agreement(), Agreement()  # each against fp16
    with torch.inference_mode():
        for index, window in enumerate(spans):
            if progress is not None:
                progress(index + 1, len(spans))
            ids = torch.tensor(window)
            log_probs_fp16 = _log_probs(model, ids, baseline, block_size)
            log_probs = _log_probs(model, ids, codecs, block_size)
            codec_figures.add(log_probs, log_probs_fp16, ids[1:])
            fp16_figures.add(log_probs_fp16, log_probs_fp16, ids[1:])
    codec_bytes = len(spans) * _window_bytes(codecs, config.num_kv_heads, config.head_dim, ctx, block_size)
    fp16_bytes = len(spans) * _window_bytes(baseline, config.num_kv_heads, config.head_dim, ctx, block_size)
    ppl, ppl_fp16 = codec_figures.ppl, fp16_figures.ppl
    return {
        "codec": codec_name, "ppl": ppl, "ppl_fp16": ppl_fp16, "rel_ppl_increase": ppl / ppl_fp16 - 1,
        "kl": codec_figures.mean_kl, "top1_agreement": codec_figures.top1_agreement,
        "compression": fp16_bytes / codec_bytes, "bits_per_element": 16 * codec_bytes / fp16_bytes,  # fp16: 16 bits
        "codec_bytes": codec_bytes, "fp16_bytes": fp16_bytes, "ctx": ctx, "block_size": block_size,
        "num_windows": len(spans), "num_predictions": codec_figures.num_predictions,
    }


def _log_probs(model: Llama, ids: torch.Tensor, codecs: Sequence[KvCodec], block_size: int) -> torch.Tensor:
    """Next-token log-probabilities, fp32 [len(ids) - 1, vocab], for every position that has a next token."""
    positions = torch.arange(ids.shape[0])
    hidden = model(ids, positions, DenseCodecAttention(codecs, block_size, model.rotary))
    return model.compute_logits(hidden[:-1]).log_softmax(dim=-1)


def _window_bytes(codecs: Sequence[KvCodec], kv_heads: int, head_dim: int, ctx: int, block_size: int) -> int:
    """Bytes of one window's full blocks over every layer, block 0 stored as a sequence's first."""
    num_full = ctx // block_size
    return sum(
        codec.num_bytes(kv_heads, block_size, head_dim, starts_sequence=True)
        + (num_full - 1) * codec.num_bytes(kv_heads, block_size, head_dim)
        for codec in codecs
    )
