"""The shape of a Llama-family model: one frozen dataclass, read from GGUF metadata or a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyper-parameters; everything the model, the KV pool and the cost models need to know."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_layer_matmul_parameters(self) -> int:
        """Weights of every layer's matmuls (q, k, v, o, gate, up, down): each costs 2 FLOPs per token."""
        h = self.hidden_size
        attention = 2 * h * self.num_heads * self.head_dim + 2 * h * self.num_kv_heads * self.head_dim
        return self.num_layers * (attention + 3 * h * self.intermediate_size)

    @property
    def num_parameters(self) -> int:
        """Weights in the model (embedding counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.num_heads * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h
