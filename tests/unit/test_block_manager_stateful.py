"""Model-based stateful tests of the block manager: random allocate/append/compute/load/free over small pools, with
its events replayed into the index they describe."""

from __future__ import annotations

import pytest
from block_probes import observable, registered_tokens
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.engine.blocks import BlockManager, OutOfBlocks
from shared.wire.block_hash import make_namespace
from shared.wire.protocol.messages import STORED

NS = make_namespace("test-model", "fp16")


# ---- block manager: model-based stateful tests -------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/mark_computed/load/free over a small pool and vocabulary, so prefixes collide often.

    The model tracks, per physical block, the token prefix whose KV it holds (None: garbage or partial), as a
    runner writing KV would leave it; a loading block holds its KV only once its load finished. Reusing a block
    whose KV belongs to another prefix, or has not arrived, is the bug to catch.
    """

    num_blocks, block_size, vocab_size, max_len = 8, 2, 2, 7

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(self.num_blocks, self.block_size, NS, on_event=self.replay)
        self.tokens: dict[int, list[int]] = {}
        self.kv: dict[int, tuple[int, ...] | None] = dict.fromkeys(range(self.num_blocks))
        self.next_seq_id = 0
        self.prompts: list[list[int]] = []  # new prompts often extend a prefix of an earlier one
        self.loading: dict[int, range] = {}  # seq id -> its table indices whose KV is still on its way
        self.replayed: set[int] = set()  # the index as the manager's events describe it

    def replay(self, kind: str, hashes: list[int]) -> None:
        if kind == STORED:
            self.replayed.update(hashes)
        else:
            self.replayed.difference_update(hashes)

    def draw_tokens(self, data: st.DataObject, min_size: int) -> list[int]:
        token = st.integers(0, self.vocab_size - 1)
        return data.draw(st.lists(token, min_size=min_size, max_size=self.max_len))

    def cached_kv(self) -> list[tuple[int, ...] | None]:
        """The KV prefixes held by the blocks registered in the prefix index."""
        blocks = range(self.num_blocks)
        return [self.kv[b] for b in blocks if registered_tokens(self.manager, b) is not None]

    def expected_reuse(self, token_ids: list[int]) -> int:
        """Leading full blocks within token_ids[:-1] whose prefix some registered block holds."""
        cached, end = set(self.cached_kv()), self.block_size
        while end < len(token_ids) and tuple(token_ids[:end]) in cached:
            end += self.block_size
        return end - self.block_size

    def draw_prompt(self, data: st.DataObject) -> list[int]:
        if not self.prompts or data.draw(st.booleans()):
            return self.draw_tokens(data, 1)
        earlier = data.draw(st.sampled_from(self.prompts))
        prefix = earlier[: data.draw(st.integers(0, len(earlier)))]
        return (prefix + self.draw_tokens(data, 1))[: self.max_len]

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        token_ids, manager, size = self.draw_prompt(data), self.manager, self.block_size
        self.prompts.append(token_ids)
        seq_id, self.next_seq_id = self.next_seq_id, self.next_seq_id + 1
        predicted, needed = manager.num_reusable_tokens(token_ids), manager.blocks_needed(token_ids)
        num_free = manager.num_free_blocks
        assert predicted == self.expected_reuse(token_ids)
        if needed > num_free:
            before = observable(manager, list(self.tokens))
            with pytest.raises(OutOfBlocks):
                manager.allocate(seq_id, token_ids)
            assert observable(manager, list(self.tokens)) == before
            return
        assert manager.allocate(seq_id, token_ids) == predicted
        assert manager.num_free_blocks == num_free - needed
        assert manager.num_computed_tokens(seq_id) == predicted
        block_ids = manager.block_ids(seq_id)
        for i, block_id in enumerate(block_ids[: predicted // size]):
            end = (i + 1) * size
            assert manager.block_token_ids(block_id) == tuple(token_ids[end - size : end])
            assert self.kv[block_id] == tuple(token_ids[:end]), "reused a block holding another prefix's KV"
        for block_id in block_ids[predicted // size :]:
            self.kv[block_id] = None
        self.tokens[seq_id] = token_ids

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        new_tokens, manager = self.draw_tokens(data, 0)[: 2 * self.block_size], self.manager
        old_ids, num_free = manager.block_ids(seq_id), manager.num_free_blocks
        if not manager.can_append(seq_id, len(new_tokens)):
            before = observable(manager, list(self.tokens))
            with pytest.raises(OutOfBlocks):
                manager.append(seq_id, new_tokens)
            assert observable(manager, list(self.tokens)) == before
            return
        manager.append(seq_id, new_tokens)
        block_ids = manager.block_ids(seq_id)
        assert block_ids[: len(old_ids)] == old_ids
        assert manager.num_free_blocks == num_free - (len(block_ids) - len(old_ids))
        for block_id in block_ids[len(old_ids) :]:
            self.kv[block_id] = None
        self.tokens[seq_id] += new_tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        token_ids, manager, size = self.tokens[seq_id], self.manager, self.block_size
        old = manager.num_computed_tokens(seq_id)
        new = data.draw(st.integers(old, len(token_ids)))
        manager.mark_computed(seq_id, new)
        assert manager.num_computed_tokens(seq_id) == new
        block_ids = manager.block_ids(seq_id)
        for i in range(old // size, new // size):
            self.kv[block_ids[i]] = tuple(token_ids[: (i + 1) * size])
        cached = self.cached_kv()
        for i in range(old // size, new // size):  # now cached exactly once: this block or an earlier copy
            count = cached.count(tuple(token_ids[: (i + 1) * size]))
            assert count <= 1 if seq_id in self.loading else count == 1  # a loading sequence registers nothing yet

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def start_loading(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        token_ids, manager, size = self.tokens[seq_id], self.manager, self.block_size
        old = manager.num_computed_tokens(seq_id)
        if seq_id in self.loading or old % size or old + size > len(token_ids):
            return
        new = data.draw(st.integers(old // size + 1, len(token_ids) // size)) * size
        manager.start_loading(seq_id, new)
        assert manager.num_computed_tokens(seq_id) == new
        self.loading[seq_id] = range(old // size, new // size)

    @precondition(lambda self: self.loading)
    @rule(data=st.data())
    def finish_loading(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.loading)))
        self.manager.finish_loading(seq_id)
        block_ids, token_ids = self.manager.block_ids(seq_id), self.tokens[seq_id]
        for i in self.loading.pop(seq_id):  # the loader wrote their KV
            self.kv[block_ids[i]] = tuple(token_ids[: (i + 1) * self.block_size])
        computed = self.manager.num_computed_tokens(seq_id) // self.block_size
        cached = self.cached_kv()
        for i in range(computed):
            assert cached.count(tuple(token_ids[: (i + 1) * self.block_size])) == 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        manager = self.manager
        block_ids, num_free = manager.block_ids(seq_id), manager.num_free_blocks
        refs = {b: manager.ref_count(b) for b in block_ids}
        manager.free(seq_id)
        del self.tokens[seq_id]
        self.loading.pop(seq_id, None)
        assert seq_id not in manager
        assert all(manager.ref_count(b) == refs[b] - 1 for b in block_ids)
        assert manager.num_free_blocks == num_free + sum(1 for b in block_ids if refs[b] == 1)

    @invariant()
    def consistent(self) -> None:
        self.manager.check_invariants()
        assert self.replayed == set(self.manager.cached_hashes())
        for seq_id in self.tokens:
            assert self.manager.is_loading(seq_id) == (seq_id in self.loading)
        for seq_id, token_ids in self.tokens.items():
            assert self.manager.num_tokens(seq_id) == len(token_ids)
        cached = self.cached_kv()
        size = self.block_size
        for seq_id, token_ids in self.tokens.items():  # a live sequence's published prefix stays cached, once
            loading = self.loading.get(seq_id)
            num_full = loading.start if loading is not None else self.manager.num_computed_tokens(seq_id) // size
            for end in range(size, num_full * size + 1, size):
                assert cached.count(tuple(token_ids[:end])) == 1
        for block_id in range(self.num_blocks):
            tokens = registered_tokens(self.manager, block_id)
            if tokens is not None:  # a cached block holds computed KV of a prefix ending in its tokens
                kv = self.kv[block_id]
                assert kv is not None and kv[-self.block_size :] == tokens


class LargerPoolMachine(BlockManagerMachine):
    num_blocks, block_size, vocab_size, max_len = 12, 3, 2, 13


STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerSmallPool = BlockManagerMachine.TestCase
TestBlockManagerSmallPool.settings = STATEFUL
TestBlockManagerLargerPool = LargerPoolMachine.TestCase
TestBlockManagerLargerPool.settings = STATEFUL
