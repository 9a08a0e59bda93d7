"""The one place a model engine's KV store is built from its `EngineConfig`: the kind (`kv_codec`), its size
(`kv_cache_bytes`), its block manager, and FastGen's lanes over it (`kv_policy`).
"""

from __future__ import annotations

from kernels.backend import KernelBackend
from shared.engine.blocks import BlockEventHook, BlockManager
from shared.engine.config import EngineConfig
from shared.engine.kv.codec.pool import CodecKvPool
from shared.engine.kv.codec.store import CodecKvStore
from shared.engine.kv.fastgen.kv import FastGenKv
from shared.engine.kv.fastgen.store import FastGenKvStore
from shared.engine.kv.paged.pool import KVPool
from shared.engine.kv.paged.store import PagedKvStore
from shared.engine.kv.sizing import pool_size
from shared.engine.kv.store import KvStore
from shared.fastgen.token_classes import TokenClasses
from shared.kvcompress import layer_codecs, load_calibration
from shared.model.checkpoint import Checkpoint
from shared.model.llama import RotaryEmbedding
from shared.wire.block_hash import make_namespace


def build_kv_store(
    checkpoint: Checkpoint, config: EngineConfig, rotary: RotaryEmbedding, backend: KernelBackend,
    on_block_event: BlockEventHook | None = None,
) -> KvStore:
    """The store `config.kv_cache_bytes` pays for (or, at 0, what `sizing.pool_size` finds room for), on `config`'s
    device and dtype.

    Args:
        rotary: the model's RoPE tables.
        backend: the kernels attention runs on.
        on_block_event: hears every change of the prefix cache's index (`BlockManager`'s `on_event`).
    Raises:
        ValueError: a budget of fewer than 2 blocks, or a KV codec calibration that does not fit the model.
    """
    model, device, dtype = checkpoint.config, config.torch_device, config.torch_dtype
    scale = model.head_dim**-0.5
    pool_bytes = pool_size(config.kv_cache_bytes, config.kv_memory_fraction, KVPool.bytes_per_block(model, 1, dtype),
                           config.max_num_seqs * model.max_position, device)

    def blocks(num_blocks: int) -> BlockManager:
        if num_blocks < 2:
            raise ValueError(f"a KV pool of {pool_bytes >> 20} MiB holds {num_blocks} blocks; need at least 2")
        kv_format = config.kv_format if config.stage is None else config.stage.block_format(config.kv_format)
        namespace = make_namespace(checkpoint.fingerprint, kv_format)
        return BlockManager(num_blocks, config.block_size, namespace, on_block_event)

    store: KvStore
    if config.kv_codec == "none":
        num_blocks = pool_bytes // KVPool.bytes_per_block(model, config.block_size, dtype)
        manager = blocks(num_blocks)
        paged = KVPool(model, num_blocks, config.block_size, dtype, device)
        store = PagedKvStore(paged, manager, config.kv_format, scale, backend, config.max_num_seqs)
    else:
        path = config.kv_calibration_path
        calibration = None if path is None else load_calibration(path)
        name = checkpoint.path.name
        if calibration is not None and config.kv_calib is None and calibration.info.get("model") != name:
            raise ValueError(
                f"the shipped {config.kv_codec} calibration is for {calibration.info.get('model')}, not {name}: "
                "make one with `tsukimi calibrate kv --model ...` and pass --kv-calib"
            )
        codecs = layer_codecs(config.kv_codec, model.num_layers, model.num_kv_heads, model.head_dim, calibration)
        # Every running sequence holds one full-precision tail; tails take at most a quarter of the budget, and the
        # batch is capped at the number of tails.
        per_tail = CodecKvPool.bytes_per_tail(model, config.block_size, dtype)
        tails = min(config.max_num_seqs, max(1, pool_bytes // 4 // per_tail))
        budget = pool_bytes - tails * per_tail
        num_blocks = max(0, budget) // CodecKvPool.bytes_per_block(codecs[0], model, config.block_size)
        manager = blocks(num_blocks)
        coded = CodecKvPool(model, codecs, num_blocks, config.block_size, tails, dtype, device)
        store = CodecKvStore(coded, manager, config.kv_format, rotary, scale, backend)
    if config.kv_policy != "fastgen":
        return store
    classes = TokenClasses.from_tokenizer(checkpoint.tokenizer, model.vocab_size)
    fastgen = FastGenKv(config.fastgen, classes, manager, store.lane_store(), model.num_layers, model.num_kv_heads,
                        scale, hands_off=config.prompt_only)
    return FastGenKvStore(store, fastgen)
