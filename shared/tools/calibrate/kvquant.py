"""Computing a KVQuant calibration from text: Fisher information of the KV activations, key channel ranges, and
Fisher-weighted non-uniform codebooks per layer (what `tsukimi calibrate kv` runs).

Owns the procedure; the record and its file are `calibration`, the normalisation it shares with encoding `kvquant`,
the clustering `kmeans`. KVQuant (Hooper et al. 2024, section 3.4) weighs each activation by its Fisher information,
the squared gradient of the loss with respect to it, so codebook entries go where errors cost the most.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.kvquant_format import normalize_blocks, top_mask
from kernels.layer_ops import apply_rotary_ref
from shared.kvcompress.calibration import KvCalibration
from shared.kvcompress.names import KVQUANT_BITS, KVQUANT_OUTLIER_FRACTION
from shared.model.checkpoint import Checkpoint
from shared.model.llama import Llama, build_model
from shared.tools.calibrate.kmeans import weighted_kmeans_1d

DEFAULT_OUTLIER_FRACTION = KVQUANT_OUTLIER_FRACTION
MAX_KMEANS_SAMPLES = 1 << 20  # per layer and K/V: plenty for 4 to 16 centroids, and k-means stays seconds


@dataclass(frozen=True)
class CalibrationSettings:
    """What to calibrate and on what.

    Args:
        bits: code width, 2, 3 or 4.
        num_tokens: calibration tokens (rounded down to whole windows).
        window: tokens per forward/backward pass.
        block_size: the engine's block size (outliers are counted per block).
        seed: picks the windows and the k-means subsamples; equal inputs and seed give an identical file.
    """

    bits: int
    num_tokens: int = 16384
    window: int = 1024
    block_size: int = 64
    seed: int = 0
    outlier_fraction: float = DEFAULT_OUTLIER_FRACTION
    info: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.bits not in KVQUANT_BITS:
            raise ValueError(f"--bits must be one of {KVQUANT_BITS}, got {self.bits}")
        if self.window < self.block_size or self.window % self.block_size:
            raise ValueError(f"the window ({self.window}) must be a multiple of the block size ({self.block_size})")
        if self.num_tokens < self.window:
            raise ValueError(f"--tokens ({self.num_tokens}) must cover at least one window of {self.window}")


@dataclass
class LayerActivations:
    """One layer's pre-RoPE keys, values and their Fisher weights over every calibration window."""

    keys: list[torch.Tensor] = field(default_factory=list)  # each [window, kv_heads, head_dim]
    values: list[torch.Tensor] = field(default_factory=list)
    key_fisher: list[torch.Tensor] = field(default_factory=list)
    value_fisher: list[torch.Tensor] = field(default_factory=list)


class _CaptureAttention:
    """Causal attention that rotates the keys itself (so gradients reach the pre-RoPE keys) and keeps K and V."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        self.keys.append(k_pre_rope)
        self.values.append(v)
        rotated = apply_rotary_ref(k_pre_rope, self.cos, self.sin)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), rotated.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


def pick_windows(tokens: list[int], settings: CalibrationSettings) -> list[list[int]]:
    """`num_tokens // window` windows of the span, chosen by the seed among its non-overlapping windows.

    Raises:
        ValueError: the span holds fewer windows than asked for.
    """
    available = len(tokens) // settings.window
    wanted = settings.num_tokens // settings.window
    if available < wanted:
        raise ValueError(
            f"the calibration span holds {len(tokens)} tokens ({available} windows of {settings.window}), "
            f"fewer than --tokens {settings.num_tokens}"
        )
    chosen = sorted(random.Random(settings.seed).sample(range(available), wanted))
    return [tokens[i * settings.window : (i + 1) * settings.window] for i in chosen]


def collect_activations(
    model: Llama, windows: list[list[int]], progress: Callable[[int, int], None] | None = None
) -> list[LayerActivations]:
    """Forward and backward over each window: K (pre-RoPE), V and their squared loss gradients, per layer."""
    layers = [LayerActivations() for _ in model.layers]
    model.embed_tokens.weight.requires_grad_(True)  # so every activation is part of the autograd graph
    try:
        for done, window in enumerate(windows):
            ids = torch.tensor(window, dtype=torch.long)
            positions = torch.arange(len(window))
            cos, sin = model.rotary.cos_sin(positions, torch.float32)
            ctx = _CaptureAttention(cos, sin)
            with torch.enable_grad():
                hidden = model(ids, positions, ctx)
                loss = F.cross_entropy(model.compute_logits(hidden[:-1]), ids[1:])
                grads = torch.autograd.grad(loss, [*ctx.keys, *ctx.values])
            num_layers = len(layers)
            for index, layer in enumerate(layers):
                layer.keys.append(ctx.keys[index].detach().float().clone())
                layer.values.append(ctx.values[index].detach().float().clone())
                layer.key_fisher.append(grads[index].float().square())
                layer.value_fisher.append(grads[num_layers + index].float().square())
            if progress is not None:
                progress(done + 1, len(windows))
    finally:
        model.embed_tokens.weight.requires_grad_(False)
    return layers


def key_ranges(keys: torch.Tensor, outlier_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, channel) of [tokens, kv_heads, head_dim]: centre and half-range of the central 1 - f of values
    (they place the channel's grid of block ranges, `kvquant.key_grid`)."""
    tokens, heads, dim = keys.shape
    flat = keys.reshape(tokens, heads * dim)
    tail = outlier_fraction / 2
    low = torch.quantile(flat, tail, dim=0)
    high = torch.quantile(flat, 1 - tail, dim=0)
    center = (high + low) / 2
    half = ((high - low) / 2).clamp_min(1e-4)
    return center.view(heads, dim), half.view(heads, dim)


def calibrate_layer(
    layer: LayerActivations, settings: CalibrationSettings, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's key centre, key half-range, key codebook and value codebook."""
    sink_free = torch.cat([k[1:] for k in layer.keys])  # the sink is stored whole: it does not shape the ranges
    center, half = key_ranges(sink_free, settings.outlier_fraction)
    samples: dict[str, list[torch.Tensor]] = {"k": [], "kw": [], "v": [], "vw": []}
    size = settings.block_size
    n = math.ceil(settings.outlier_fraction * size * center.shape[1] - 1e-9)
    for keys, values, key_fisher, value_fisher in zip(
        layer.keys, layer.values, layer.key_fisher, layer.value_fisher, strict=True
    ):
        # [window, H, D] -> [blocks, H, block, D]; the first block starts the sequence.
        blocks = [t.view(-1, size, *t.shape[1:]).transpose(1, 2) for t in (keys, values, key_fisher, value_fisher)]
        for first, selection in ((True, slice(0, 1)), (False, slice(1, None))):
            k, v, kf, vf = (b[selection] for b in blocks)
            if not k.shape[0]:
                continue
            norm = normalize_blocks(k, v, center, half, n, starts_sequence=first)
            dense = torch.ones_like(k, dtype=torch.bool)  # what the codebooks code: all but the sink ...
            if first:
                dense[:, :, 0] = False
            value_dense = dense & ~top_mask(norm.v_rank, n)  # ... and, for values, the sparse outliers
            for name, normalized, coded, fisher in (("k", norm.k_norm, dense, kf), ("v", norm.v_norm, value_dense, vf)):
                samples[name].append(normalized[coded])
                samples[name + "w"].append(fisher[coded])
    codebooks = []
    for name in ("k", "v"):
        values_, weights = torch.cat(samples[name]), torch.cat(samples[name + "w"])
        if values_.numel() > MAX_KMEANS_SAMPLES:
            keep = torch.randperm(values_.numel(), generator=generator)[:MAX_KMEANS_SAMPLES]
            values_, weights = values_[keep], weights[keep]
        codebooks.append(weighted_kmeans_1d(values_, weights + 1e-12 * float(weights.mean()), 1 << settings.bits))
    return center, half, codebooks[0], codebooks[1]


def calibrate(
    checkpoint: Checkpoint, tokens: list[int], settings: CalibrationSettings,
    progress: Callable[[str, int, int], None] | None = None,
) -> KvCalibration:
    """The calibration of `checkpoint` at `settings.bits` from `tokens` (already the calibration span).

    Raises:
        ValueError: too few tokens for the windows asked for.
    """
    windows = pick_windows(tokens, settings)
    model = build_model(checkpoint.config, checkpoint.state_dict, torch.float32, torch.device("cpu"),
                        pack_weights=False)
    layers = collect_activations(model, windows, None if progress is None else lambda d, t: progress("fisher", d, t))
    generator = torch.Generator().manual_seed(settings.seed)
    results = []
    for index, layer in enumerate(layers):
        results.append(calibrate_layer(layer, settings, generator))
        if progress is not None:
            progress("codebooks", index + 1, len(layers))
    center, half, key_codebook, value_codebook = (torch.stack(parts) for parts in zip(*results, strict=True))
    info = {**settings.info, "tokens": len(windows) * settings.window, "window": settings.window,
            "block_size": settings.block_size, "seed": settings.seed}
    return KvCalibration(
        bits=settings.bits, outlier_fraction=settings.outlier_fraction, key_center=center, key_scale=half,
        key_codebook=key_codebook, value_codebook=value_codebook, info=info,
    )
