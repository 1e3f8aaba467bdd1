"""vLLM's KV cache event structs, as its ZmqEventPublisher encodes them (msgspec, array-like,
tagged): the tests decode what engines publish, and encode what a vLLM engine would send, with
these, never with Motor's own decoder."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def vllm_stored(hashes: list[Any], parent: Any, tokens: list[int], size: int) -> BlockStored:
    return BlockStored(hashes, parent, tokens, size, None, "GPU", None)


DECODE = msgspec.msgpack.Decoder(KVEventBatch).decode
