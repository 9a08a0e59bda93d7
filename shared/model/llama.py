"""A Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) in plain PyTorch, read top to bottom.

Owns the weights and the arithmetic of one forward pass. It does not own the KV cache: each attention layer hands its
rotated q, k, v (and k before rotation, for KV codecs that quantize keys pre-RoPE) to an `AttentionContext` (the
engine's paged cache, or `DenseCausalAttention` for a cache-free pass).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels.layer_ops import REFERENCE_OPS, LayerOps
from shared.model.config import LlamaConfig
from shared.model.cpu_linear import can_pack, pack_linears
from shared.model.stages import LayerRange


class AttentionContext(Protocol):
    """Where attention happens: stores this step's k/v for a layer and attends q over everything visible."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v, k_pre_rope: [num_tokens, num_kv_heads, head_dim].

        q and k are rotated by position; `k_pre_rope` is k before rotation (a view, free to ignore).
        Returns [num_tokens, num_heads, head_dim].
        """
        ...


class RMSNorm(nn.Module):
    ops: LayerOps = REFERENCE_OPS

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normalised sum, the sum) of x and the residual stream (x alone when None); normalised in fp32 as the
        reference implementation does, then returned to the model dtype."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention (the GGUF loader un-permutes Q/K rows to match it)."""

    cos: torch.Tensor  # [max_position, head_dim / 2], fp32
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, head_dim/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens] -> two [num_tokens, 1, head_dim] tables, shared by every layer of one step."""
        cos = self.cos[positions].repeat(1, 2).unsqueeze(1).to(dtype)
        sin = self.sin[positions].repeat(1, 2).unsqueeze(1).to(dtype)
        return cos, sin


class Attention(nn.Module):
    ops: LayerOps = REFERENCE_OPS

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projected by one matmul: one pass over the activations instead of three.
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        # q and k heads sit side by side in the projection: rotate them in one pass.
        q, k = self.ops.apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = ctx.attend(self.layer_idx, q, k, v, qk[:, self.num_heads :])  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    ops: LayerOps = REFERENCE_OPS

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the next norm adds the two, so that each add
        is fused into the norm after it. `residual` None: x is the residual stream itself (the first layer)."""
        hidden, residual = self.input_layernorm(x, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, ctx), residual)
        return self.mlp(hidden), residual


class Llama(nn.Module):
    """The decoder, or the layers of it one pipeline stage computes (`layers`; default: all of them). `forward` maps
    a flat list of tokens (any mix of sequences) to final hidden states, or, for a stage before the last, to the
    residual stream the next stage continues from.

    A stage holds its own layers only, numbered from 0 (as its KV store numbers them), the embedding if it is the
    first (or the last with tied embeddings), and the final norm and LM head if it is the last.
    """

    def __init__(self, config: LlamaConfig, layers: LayerRange | None = None) -> None:
        super().__init__()
        self.config = config
        self.stage = layers or LayerRange.whole(config.num_layers)
        self.layer_offset = 0  # what its layers' own indices exceed the stage's (a `stage_of` view: its start)
        if self.stage.is_first or (self.stage.is_last and config.tie_word_embeddings):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(len(self.stage)))
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta)
        if self.stage.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight

    def stage_of(self, layers: LayerRange) -> Llama:
        """This whole model's `layers` as a stage that shares its weights (no copy): a prefill instance of a
        pipeline group runs short prompts on the whole model and its stage of long ones on this."""
        if not self.stage.is_whole or layers.num_layers != self.config.num_layers:
            raise ValueError(f"{layers} of a model that holds {self.stage}")
        with torch.device("meta"):  # what the stage would own, replaced by this model's modules below
            view = Llama(self.config, layers)
        view.layers = nn.ModuleList(self.layers[layers.start : layers.end])
        view.layer_offset = layers.start  # its layers number themselves as in this model
        view.rotary = self.rotary
        if hasattr(view, "embed_tokens"):
            view.embed_tokens = self.embed_tokens
        if layers.is_last:
            view.norm, view.lm_head = self.norm, self.lm_head
        return view

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> [num_tokens, hidden_size]: hidden states after the final norm (the
        last stage), or the residual stream after this stage's layers (a stage before it). `hidden` is the
        previous stage's output (None: the first stage embeds `input_ids`)."""
        if (hidden is None) != self.stage.is_first:
            raise ValueError(f"{self.stage}: the first stage embeds tokens, the others continue a hidden state")
        x, residual = (self.embed_tokens(input_ids) if hidden is None else hidden), None
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if self.layer_offset:  # a view's layers (`stage_of`): the KV store numbers them from 0
            ctx = _OffsetContext(ctx, self.layer_offset)
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        if not self.stage.is_last:
            assert residual is not None  # a stage has at least one layer
            return x + residual
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> fp32 logits [n, vocab_size]; call it only on the rows that will be sampled."""
        return self.lm_head(hidden).float()


class _OffsetContext:
    """An attention context seen by layers that number themselves `offset` higher than it does."""

    def __init__(self, ctx: AttentionContext, offset: int) -> None:
        self.ctx, self.offset = ctx, offset

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        return self.ctx.attend(layer_idx - self.offset, q, k, v, k_pre_rope)


def use_layer_ops(model: nn.Module, ops: LayerOps) -> None:
    """Run `model`'s norms, rotary and SwiGLU with `ops` (the references by default; the C++ ones on CPU)."""
    for module in model.modules():
        if isinstance(module, RMSNorm | Attention | MLP):
            module.ops = ops


class DenseCausalAttention:
    """A cache-free context for one sequence: plain causal attention over the tokens of this pass."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pre_rope: torch.Tensor
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


def fuse_hf_state_dict(
    state_dict: dict[str, torch.Tensor], config: LlamaConfig, dtype: torch.dtype | None = None,
    device: torch.device | None = None, layers: LayerRange | None = None,
) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names -> this module's names (q/k/v and gate/up fused), as new tensors in `dtype` on
    `device` (None: as given); `state_dict` is left as it was. With `layers`, the weights of that stage alone
    (`Llama`'s), its layers numbered from 0."""

    def take(name: str) -> torch.Tensor:
        return state_dict[name].to(device=device, dtype=dtype, copy=True)

    def fused(names: list[str]) -> torch.Tensor:
        return torch.cat([state_dict[n].to(device=device, dtype=dtype) for n in names], dim=0)

    stage = layers or LayerRange.whole(config.num_layers)
    out: dict[str, torch.Tensor] = {}
    if stage.is_first or (stage.is_last and config.tie_word_embeddings):
        out["embed_tokens.weight"] = take("model.embed_tokens.weight")
    if stage.is_last:
        out["norm.weight"] = take("model.norm.weight")
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = take("lm_head.weight")
    for i in range(stage.start, stage.end):
        hf, ours = f"model.layers.{i}.", f"layers.{i - stage.start}."
        out[f"{ours}self_attn.qkv_proj.weight"] = fused([f"{hf}self_attn.{p}_proj.weight" for p in "qkv"])
        out[f"{ours}self_attn.o_proj.weight"] = take(f"{hf}self_attn.o_proj.weight")
        out[f"{ours}mlp.gate_up_proj.weight"] = fused([f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up")])
        out[f"{ours}mlp.down_proj.weight"] = take(f"{hf}mlp.down_proj.weight")
        out[f"{ours}input_layernorm.weight"] = take(f"{hf}input_layernorm.weight")
        out[f"{ours}post_attention_layernorm.weight"] = take(f"{hf}post_attention_layernorm.weight")
    return out


DUMMY_WEIGHT_RANGE = 1e-3  # uniform weights in [-r, r], as vLLM's dummy loader: activations stay finite at any depth


def build_dummy_model(
    config: LlamaConfig, dtype: torch.dtype, device: torch.device, seed: int = 0, layers: LayerRange | None = None
) -> Llama:
    """The decoder (or the stage `layers`) at `config`'s shape with random weights (norms 1), made in `dtype` on
    `device` with no copy elsewhere: what `build_model` gives, for measuring speed where the real weights are not at
    hand. A stage's weights are not the whole model's of the same seed."""
    with torch.device("meta"):
        model = Llama(config, layers)
    model = model.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
    if config.tie_word_embeddings and model.stage.is_last:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.eval().requires_grad_(False)
    model.rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta).to(device)
    if can_pack(device, dtype):
        pack_linears(model)
    return model


def build_model(
    config: LlamaConfig, hf_state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
    pack_weights: bool = True, layers: LayerRange | None = None,
) -> Llama:
    """Instantiate the decoder (or the stage `layers` of it, with that stage's weights alone) on `device` in `dtype`
    with the given Hugging Face-named weights, in eval mode.

    `pack_weights=False` keeps plain `nn.Linear` layers on CPU (autograd works through them; packed ones are
    inference-only).
    """
    with torch.device("meta"):
        model = Llama(config, layers)
    # The weights are converted once, straight into the model (no second copy of the whole model at the
    # checkpoint's dtype), so that loading takes about one model's memory beside the checkpoint.
    weights = fuse_hf_state_dict(hf_state_dict, config, dtype, device, layers)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    del weights
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings and model.stage.is_last:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.eval().requires_grad_(False)
    # RoPE tables stay fp32 whatever the weights are; they are cast per step, after the lookup.
    model.rotary = RotaryEmbedding(config.head_dim, config.max_position, config.rope_theta).to(device)
    if pack_weights and can_pack(device, dtype):
        pack_linears(model)  # the tied lm_head gets its own packed copy; the embedding stays for lookups
    return model
