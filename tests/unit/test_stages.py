"""Pipeline stages: layer ranges that cover a model, and the rows a stage after the first computes from."""

from __future__ import annotations

import pytest
import torch

from shared.engine.stage_input import StageInput
from shared.model.stages import LayerRange, split_layers


@pytest.mark.parametrize(("num_layers", "num_stages"), [(30, 1), (30, 2), (30, 4), (7, 3), (5, 5)])
def test_split_layers_covers_the_model_evenly(num_layers: int, num_stages: int) -> None:
    ranges = split_layers(num_layers, num_stages)
    assert len(ranges) == num_stages and ranges[0].is_first and ranges[-1].is_last
    assert [r.start for r in ranges[1:]] == [r.end for r in ranges[:-1]]  # contiguous, in order
    assert sum(len(r) for r in ranges) == num_layers
    assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
    assert (num_stages == 1) == ranges[0].is_whole


def test_layer_ranges_are_checked() -> None:
    for start, end in [(0, 0), (3, 2), (-1, 2), (0, 31)]:
        with pytest.raises(ValueError, match="not a stage"):
            LayerRange(start, end, 30)
    for stages in (0, 31):
        with pytest.raises(ValueError, match="1 to 30 stages"):
            split_layers(30, stages)
    assert str(LayerRange(15, 30, 30)) == "layers 15-29 of 30"


def test_stage_input_hands_out_rows_in_order_across_arrivals() -> None:
    rows = torch.arange(40, dtype=torch.float32).view(10, 4)  # tokens 6..15 of a 16-token prompt
    stage_input = StageInput(6, 16)
    stage_input.append(rows[:3])
    stage_input.append(rows[3:7])
    assert stage_input.end == 13
    assert torch.equal(stage_input.take(6, 5), rows[:5])  # across two arrivals
    with pytest.raises(ValueError, match="held"):
        stage_input.take(11, 3)  # tokens 13.. have not arrived
    with pytest.raises(ValueError, match="held"):
        stage_input.take(12, 1)  # not the next in order
    stage_input.append(rows[7:])
    assert torch.equal(stage_input.take(11, 5), rows[5:])
    with pytest.raises(ValueError, match="prompt of 16"):
        stage_input.append(rows[:1])
    with pytest.raises(ValueError, match="num_tokens, hidden_size"):
        StageInput(0, 4).append(torch.zeros(4))
    with pytest.raises(ValueError, match="stage input from token 4"):
        StageInput(4, 4)
