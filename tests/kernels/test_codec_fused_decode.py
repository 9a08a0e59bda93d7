"""The engine's kvquant pool on the Triton backend (through the interpreter on CPU) gives what its torch path gives,
step after step: blocks packed by the pack kernel are the codec's bytes (a sequence's first block with key ranges
that leave the sink out), and the fused decode kernel attends as dequantize-then-attend does over packed blocks, the
sink, a tail, and a block filling up during the step; prefill chunks of the same steps keep the reference path."""

from __future__ import annotations

import torch

from kernels.backend import KernelBackend
from kernels.layer_ops import apply_rotary_ref
from shared.engine.batching import ScheduledChunk
from shared.engine.kv.codec.attention import CodecAttention, CodecStepLayout
from shared.engine.kv.codec.fused_decode import FusedDecode
from shared.engine.kv.codec.pool import CodecKvPool
from shared.engine.sequence import Sequence
from shared.kvcompress.kvquant import KvQuantCodec
from shared.model.config import LlamaConfig
from shared.model.llama import RotaryEmbedding
from shared.wire.protocol import SamplingParams

BLOCK, HEADS, KV_HEADS, DIM = 16, 6, 2, 32
CONFIG = LlamaConfig(
    vocab_size=32, hidden_size=HEADS * DIM, intermediate_size=16, num_layers=1, num_heads=HEADS,
    num_kv_heads=KV_HEADS, head_dim=DIM, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=256,
    tie_word_embeddings=True,
)


def make_pool() -> CodecKvPool:
    g = torch.Generator().manual_seed(0)
    codebook = torch.sort(torch.rand(8, generator=g) * 2 - 1).values
    codec = KvQuantCodec(3, torch.randn(KV_HEADS, DIM, generator=g) * 0.2, torch.rand(KV_HEADS, DIM, generator=g) + 1,
                         codebook, codebook * 0.9, 0.02)
    return CodecKvPool(CONFIG, [codec], 32, BLOCK, 4, torch.float32, torch.device("cpu"))


def test_fused_decode_matches_the_reference_path_over_steps(triton_ready: None) -> None:
    rotary = RotaryEmbedding(DIM, 256, 10000.0)
    pools = {"torch": make_pool(), "triton": make_pool()}
    fused = FusedDecode(pools["triton"], rotary)
    g = torch.Generator().manual_seed(1)
    total = {"a": 40, "b": 21}
    q_all = {r: torch.randn(n, HEADS, DIM, generator=g) for r, n in total.items()}
    k_all = {r: torch.randn(n, KV_HEADS, DIM, generator=g) for r, n in total.items()}
    v_all = {r: torch.randn(n, KV_HEADS, DIM, generator=g) for r, n in total.items()}
    k_all["a"][0, :, :2] *= 6.0  # a's sink far out in two channels: block 0's key ranges must leave it out
    tables = {"a": [3, 5, 7], "b": [10, 11]}
    # a: prefill 31 tokens, then decode 9 (its token 31 fills block 1 during a decode step); b: prefill 15, decode 6.
    steps = [{"a": 31, "b": 15}] + [{"a": 1, "b": 1}] * 6 + [{"a": 1}] * 3
    outputs = {name: [] for name in pools}
    for name, pool in pools.items():
        seqs = {r: Sequence(r, list(range(n)), n, SamplingParams()) for r, n in total.items()}
        for step in steps:
            order = sorted(step, key=lambda r: step[r] > 1)
            chunks = [ScheduledChunk(seqs[r], step[r]) for r in order]
            layout = CodecStepLayout.build(chunks, tables, pool, torch.device("cpu"))
            spans = [slice(seqs[r].num_computed_tokens, seqs[r].num_computed_tokens + step[r]) for r in order]
            positions = torch.cat([torch.arange(s.start, s.stop) for s in spans])
            cos, sin = rotary.cos_sin(positions, torch.float32)
            q = apply_rotary_ref(torch.cat([q_all[r][s] for r, s in zip(order, spans, strict=True)]), cos, sin)
            k_pre = torch.cat([k_all[r][s] for r, s in zip(order, spans, strict=True)])
            v = torch.cat([v_all[r][s] for r, s in zip(order, spans, strict=True)])
            is_fused = name == "triton"
            ctx = CodecAttention(pool, layout, DIM**-0.5, rotary, fused=fused if is_fused else None,
                                 backend=KernelBackend.TRITON if is_fused else KernelBackend.TORCH)
            outputs[name].append(ctx.attend(0, q, apply_rotary_ref(k_pre, cos, sin), v, k_pre))
            for r in order:
                seqs[r].num_computed_tokens += step[r]
    for expected, got in zip(outputs["torch"], outputs["triton"], strict=True):
        assert torch.allclose(got, expected, atol=2e-4), (got - expected).abs().max()
    # Blocks packed by the pack kernel (the Triton pool's encoder) are the codec's bytes, sinks included.
    assert pools["triton"].encoder is not None and pools["torch"].encoder is None
    assert torch.equal(pools["torch"].packed, pools["triton"].packed)
    assert torch.equal(pools["torch"].sinks, pools["triton"].sinks) and pools["torch"].sinks.any()
