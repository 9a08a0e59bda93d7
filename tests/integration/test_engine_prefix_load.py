"""Layer-wise prefix loading: a prefix whose KV arrives layer by layer while the step computes gives the same tokens as
computing it, the step waits for each layer and starts before the last one is in, and a load that fails mid-way is
recomputed. `PrefixLoad` itself on a small pool first."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernels.backend import KernelBackend
from shared.engine.blocks import BlockManager
from shared.engine.engine import LLMEngine
from shared.engine.kv.paged.pool import KVPool
from shared.engine.kv.paged.store import PagedKvStore
from shared.engine.kv.prefix_load import PrefixLoad, PrefixSource
from shared.model.config import LlamaConfig
from shared.wire.protocol import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# ---- PrefixLoad on a small pool -------------------------------------------------------------------------------


def small_store(num_layers: int = 3) -> PagedKvStore:
    config = LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=num_layers, num_heads=2, num_kv_heads=2,
        head_dim=4, rope_theta=1e4, rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=True,
    )
    pool = KVPool(config, num_blocks=4, block_size=2, dtype=torch.float32, device=torch.device("cpu"))
    return PagedKvStore(pool, BlockManager(4, 2), "fp32", 0.5, KernelBackend.TORCH, max_num_seqs=4)


def block_bytes(kv: torch.Tensor) -> bytes:
    return kv.contiguous().view(torch.uint8).numpy().tobytes()


def test_layers_become_ready_as_every_block_brings_them_in_any_pieces() -> None:
    store = small_store()
    blocks = torch.randn(3, 2, 2, 2, 2, 4)  # [num_layers, 2, kv_heads, num_blocks, block_size, head_dim]
    load = PrefixLoad(store, [3, 1])
    data = [block_bytes(blocks[:, :, :, b : b + 1]) for b in range(2)]
    layer = load.layer_sizes[0]
    assert load.write(0, data[0][: 2 * layer + 5])  # block 0: two layers and a few bytes of the third
    assert load.num_ready_layers == 0  # block 1 has nothing yet
    assert load.write(1, data[1][:layer])
    assert load.num_ready_layers == 1 and load.wait_layer(0)
    assert load.write(1, data[1][layer:])
    assert load.num_ready_layers == 2 and not load.is_complete
    assert load.write(0, data[0][2 * layer + 5 :])
    assert load.is_complete and load.wait_layer(2)
    assert torch.equal(store.pool.read_blocks([3, 1]), blocks)


def test_a_failed_or_closed_load_takes_no_more_bytes_and_wakes_the_waiter() -> None:
    store = small_store()
    load = PrefixLoad(store, [0])
    assert not load.write(0, bytes(load.block_sizes[0] + 1))  # more than a block holds
    assert load.error is not None and not load.wait_layer(0)
    waiting = PrefixLoad(store, [1])
    timer = threading.Timer(0.05, waiting.fail, ["the block vanished"])
    timer.start()
    assert not waiting.wait_layer(0) and waiting.waited_s >= 0.04
    assert not waiting.write(0, bytes(waiting.layer_sizes[0])) and store.pool.tensor[0, :, :, 1].abs().sum() == 0
    closed = PrefixLoad(store, [2])
    closed.close()
    assert not closed.write(0, bytes(closed.layer_sizes[0])) and not closed.wait_layer(0)


def test_a_stalled_load_times_out() -> None:
    load = PrefixLoad(small_store(), [0], timeout_s=0.05)
    assert load.write(0, bytes(load.layer_sizes[0]))  # progress keeps it alive; then nothing comes
    assert load.wait_layer(0) and not load.wait_layer(1)
    assert "no progress" in (load.error or "")


# ---- on the real model ------------------------------------------------------------------------------------------


class SlowLoader:
    """A `PrefixSource` start that feeds exported blocks from a thread, one layer every `delay_s`, and can fail."""

    def __init__(self, engine: LLMEngine, blocks: torch.Tensor, delay_s: float, fail_at: int | None = None) -> None:
        self.engine, self.blocks, self.delay_s, self.fail_at = engine, blocks, delay_s, fail_at
        self.arrived: dict[int, float] = {}  # layer -> when its last piece went in
        self.num_starts = 0

    def start(self, first_block: int, block_ids: list[int]) -> PrefixLoad:
        self.num_starts += 1
        load = PrefixLoad(self.engine.store, block_ids)
        threading.Thread(target=self._feed, args=(load, first_block), daemon=True).start()
        return load

    def _feed(self, load: PrefixLoad, first_block: int) -> None:
        for layer in range(self.blocks.shape[0]):
            time.sleep(self.delay_s)
            if layer == self.fail_at:
                load.fail("the store lost a block")
                return
            for b in range(len(load.block_ids)):
                if b == len(load.block_ids) - 1:
                    self.arrived[layer] = time.monotonic()
                load.write(b, block_bytes(self.blocks[layer, :, :, first_block + b]))


def run(engine: LLMEngine, prompt: list[int], source: PrefixSource | None, calls: list[tuple[int, float]]):  # noqa: ANN201
    """Generate to the end; `calls` gets (layer, time) of each on_layer call for the request. Returns the tokens,
    the last output and the first step's stats."""

    def on_layer(layer_idx: int, seqs: list) -> None:  # noqa: ANN001
        calls.extend((layer_idx, time.monotonic()) for s in seqs if s.request_id == "r")

    engine.add_request("r", prompt, GREEDY, source)
    tokens: list[int] = []
    outs, stats = [], []
    while engine.has_unfinished():
        for out in engine.step(on_layer):
            tokens += out.new_token_ids
            outs.append(out)
        stats.append(engine.last_step)
    return tokens, outs[-1], stats[0]


@pytest.fixture(scope="module")
def reference(make_engine):
    """A prompt, its greedy tokens computed whole, and its full blocks' KV from the engine that computed them."""
    source = make_engine()
    prompt = source.tokenizer.encode("The moon festival is celebrated in autumn, when families gather to " * 3)
    (expected,) = source.generate([prompt], GREEDY)
    num_blocks = (len(prompt) - 1) // source.config.block_size
    source.add_request("x", prompt, GREEDY)
    source.step()
    blocks = source.store.pool.read_blocks(source.block_manager.block_ids("x")[:num_blocks])  # a raw pool's
    source.abort("x")
    return prompt, expected.token_ids, blocks


@pytest.mark.slow
def test_a_prefix_loaded_layer_by_layer_overlaps_compute_and_gives_the_same_tokens(make_engine, reference) -> None:
    prompt, expected, blocks = reference
    target = make_engine()
    loader = SlowLoader(target, blocks, delay_s=0.01)
    num_loaded = blocks.shape[3] * target.config.block_size
    calls: list[tuple[int, float]] = []
    tokens, last, stats = run(target, prompt, PrefixSource(num_loaded, loader.start), calls)
    assert tokens == expected
    assert last.num_cached_tokens == num_loaded and loader.num_starts == 1
    num_new = len(prompt) - num_loaded  # only these went through the model, each attending the loaded prefix too
    assert stats.num_new_tokens == num_new
    assert stats.attention_work == num_new * num_loaded + num_new * (num_new + 1) // 2
    assert stats.load_wait_s > 0 and stats.seconds > 0
    first_step = dict(calls[: target.model_config.num_layers])
    assert sorted(first_step) == list(range(target.model_config.num_layers))
    assert all(first_step[layer] >= loader.arrived[layer] for layer in first_step)  # each layer waited for its KV
    assert first_step[0] < loader.arrived[max(loader.arrived)]  # computing began before the last layer came
    assert target.block_manager.num_reusable_tokens(prompt) == num_loaded  # registered once all of it was in


@pytest.mark.slow
def test_a_load_that_fails_mid_way_is_recomputed(make_engine, reference) -> None:
    prompt, expected, blocks = reference
    target = make_engine()
    loader = SlowLoader(target, blocks, delay_s=0.002, fail_at=10)
    num_layers = target.model_config.num_layers
    calls: list[tuple[int, float]] = []
    tokens, last, _ = run(target, prompt, PrefixSource(blocks.shape[3] * target.config.block_size, loader.start), calls)
    assert tokens == expected and last.num_cached_tokens == 0  # computed from scratch: nothing local to reuse
    # Layers 0-9 were streamed from the failed attempt (their KV was verified), then every layer from the retry.
    assert [layer for layer, _ in calls] == list(range(10)) + list(range(num_layers))
    assert loader.num_starts == 1
    assert target.block_manager.num_reusable_tokens(prompt) == blocks.shape[3] * target.config.block_size
