"""Pipeline stages: the contiguous layers of a model that one stage of a chunked pipeline computes (Mooncake's CPP,
arXiv 2407.00079 section 5.1). The first stage embeds tokens, the last applies the final norm and the LM head; between
stages travels the residual stream of each token, one row of `hidden_size` values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shared.model.config import LlamaConfig


@dataclass(frozen=True)
class LayerRange:
    """Layers [start, end) of a model of `num_layers`.

    Raises:
        ValueError: an empty range or one outside the model.
    """

    start: int
    end: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= self.num_layers:
            raise ValueError(f"layers [{self.start}, {self.end}) are not a stage of a {self.num_layers}-layer model")

    @classmethod
    def whole(cls, num_layers: int) -> LayerRange:
        return cls(0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        """It embeds the tokens."""
        return self.start == 0

    @property
    def is_last(self) -> bool:
        """It samples: the final norm and the LM head are its."""
        return self.end == self.num_layers

    @property
    def is_whole(self) -> bool:
        return self.is_first and self.is_last

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"layers {self.start}-{self.end - 1} of {self.num_layers}"

    def block_format(self, kv_format: str) -> str:
        """The KV format in the block-hash namespace of this stage's blocks: they hold its layers alone, so never the
        same block as another stage's or a whole model's."""
        return kv_format if self.is_whole else f"{kv_format}@{self.start}-{self.end}"

    def local_config(self, config: LlamaConfig) -> LlamaConfig:
        """The model's shape as this stage holds it: its layers only (its KV pool and cost are sized by it)."""
        if config.num_layers != self.num_layers:
            raise ValueError(f"a stage of a {self.num_layers}-layer model for a model of {config.num_layers}")
        return dataclasses.replace(config, num_layers=len(self))


def split_layers(num_layers: int, num_stages: int) -> list[LayerRange]:
    """`num_stages` contiguous ranges covering the model, as even as can be (the first ones a layer longer).

    Raises:
        ValueError: fewer than one stage, or more stages than layers.
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"a {num_layers}-layer model splits into 1 to {num_layers} stages, not {num_stages}")
    size, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        end = start + size + (stage < extra)
        ranges.append(LayerRange(start, end, num_layers))
        start = end
    return ranges
