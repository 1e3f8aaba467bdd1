"""The engines' KV cache events on the wire: vLLM's ``KVEventBatch`` in msgpack.

A batch is ``[ts, events, data_parallel_rank]`` and each event a tagged list whose first item is
its class name (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, ...]``,
``["BlockRemoved", block_hashes, ...]``, ``["AllBlocksCleared"]``): vLLM encodes its structs
array-like. Newer vLLM encodes them as maps instead (``{"type": "BlockStored", "block_hashes":
..., ...}``, the batch as ``{"ts": ..., "events": ...}``); both are accepted. Each release appends
fields (``lora_id``, ``medium``, ``lora_name``, ``extra_keys``, ``group_idx`` ...) and older ones
lack the trailing ones (no ``data_parallel_rank``, no ``medium``): only the leading fields Motor
uses are required, the rest are ignored. An event of a kind Motor does not know is skipped and
counted (``Batch.unknown``), so a newer engine still feeds the index.

The payload comes from another process, possibly buggy: :func:`decode` raises :class:`WireError`
for anything malformed and never another exception, so a bad batch cannot crash a subscriber.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

BlockHash = int | bytes  # vLLM hashes blocks to 64-bit ints (older) or SHA-256 digests (newer)

# The replay socket's end-of-replay marker, where a sequence number would be.
SEQ_END = (-1).to_bytes(8, "big", signed=True)


class WireError(ValueError):
    """A payload that is not a KV event batch Motor can read."""


@dataclass(slots=True)
class Stored:
    """Blocks an engine cached: ``token_ids`` are those blocks' tokens, ``block_size`` per block;
    ``parent`` is the engine hash of the block before the first one (None: a sequence's first).
    The ids are an ``array('q')``, or a list when one does not fit 64 bits."""

    block_hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None  # "GPU", "CPU" ...; None when the engine does not say

    def __post_init__(self) -> None:
        if type(self.token_ids) is not array:
            try:
                self.token_ids = array("q", self.token_ids)
            except OverflowError:  # not an engine's, but hashable all the same
                self.token_ids = list(self.token_ids)


@dataclass(slots=True)
class Removed:
    """Blocks an engine evicted."""

    block_hashes: list[BlockHash]
    medium: str | None = None


@dataclass(slots=True)
class Cleared:
    """The engine dropped its whole prefix cache (a reset, a sleep)."""


Event = Stored | Removed | Cleared


@dataclass(slots=True)
class Batch:
    ts: float  # the engine's time.time() when it published the batch
    events: list[Event]
    dp_rank: int | None = None
    unknown: int = field(default=0, compare=False)  # events of kinds skipped as unknown


_STORED, _REMOVED, _CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
# Where each field Motor reads sits in the array-like form (index 0 is the tag).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")
_TOKENS = list[int]
_HASH_TYPES = frozenset((int, bytes))  # exact types: a bool is no hash
_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


# vLLM's own form, typed: what every batch of a current engine is. msgspec decodes and checks it
# in one pass (half the time of decoding it generically, then checking it), and ignores trailing
# fields it does not name. Anything else (maps, kinds Motor does not know, values it refuses)
# goes the generic way, which accepts all of it that is valid and says what is not.
class _StoredForm(msgspec.Struct, array_like=True, tag=_STORED):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: msgspec.Raw  # read by _ids_of: Python ints of them would cost more than hashing them
    block_size: int
    lora_id: Any = None
    medium: str | None = None


class _RemovedForm(msgspec.Struct, array_like=True, tag=_REMOVED):
    block_hashes: list[int | bytes]
    medium: str | None = None


class _ClearedForm(msgspec.Struct, array_like=True, tag=_CLEARED):
    pass


class _BatchForm(msgspec.Struct, array_like=True):
    ts: float
    events: list[_StoredForm | _RemovedForm | _ClearedForm]
    data_parallel_rank: int | None = None


_typed = msgspec.msgpack.Decoder(_BatchForm)
_MAPS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # msgpack's map headers


def _decode_typed(payload: bytes) -> Batch | None:
    """The batch, if ``payload`` is one in vLLM's array-like form with nothing to refuse."""
    if not payload or payload[0] in _MAPS:
        return None
    try:
        raw = _typed.decode(payload)
    except (msgspec.MsgspecError, RecursionError, TypeError):
        return None
    if not math.isfinite(raw.ts):
        return None
    events: list[Event] = []
    for e in raw.events:
        if type(e) is _StoredForm:
            ids = _ids_of(e.token_ids)
            if ids is None or e.block_size <= 0:
                return None
            events.append(Stored(e.block_hashes, e.parent_block_hash, ids, e.block_size, e.medium))
        elif type(e) is _RemovedForm:
            events.append(Removed(e.block_hashes, e.medium))
        else:
            events.append(Cleared())
    return Batch(raw.ts, events, raw.data_parallel_rank)


def _ids_of(packed: msgspec.Raw) -> Sequence[int] | None:
    """A typed batch's token ids, if they are an array of 64-bit ints."""
    try:
        return array("q", msgspec.msgpack.decode(packed, type=_TOKENS))
    except (msgspec.MsgspecError, ValueError, OverflowError):
        return None


def decode(payload: bytes) -> Batch:
    """The batch in ``payload``; :class:`WireError` if it is not one."""
    return _decode_typed(payload) or _decode_any(payload)


def _decode_any(payload: bytes) -> Batch:
    try:
        raw = _decoder.decode(payload)
    except (msgspec.MsgspecError, RecursionError) as exc:  # deep nesting is a RecursionError
        raise WireError(f"not msgpack: {exc}") from None
    except TypeError as exc:  # not a bytes-like payload at all
        raise WireError(str(exc)) from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise WireError("a batch map needs ts and events")
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise WireError("a batch is a [ts, events, ...] array or a map")
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise WireError(f"bad batch ts {ts!r}")
    if rank is not None and type(rank) is not int:
        raise WireError(f"bad data_parallel_rank {rank!r}")
    if not isinstance(events, list):
        raise WireError("a batch's events must be an array")
    batch = Batch(float(ts), [], rank)
    for raw_event in events:
        event = _event(raw_event)
        if event is None:
            batch.unknown += 1
        else:
            batch.events.append(event)
    return batch


def _fields(raw: Any, names: tuple[str, ...], required: int) -> list[Any]:
    """An event's first ``len(names)`` fields, None for the absent optional ones."""
    if isinstance(raw, list):
        values = raw[1 : 1 + len(names)]
        if len(values) < required:
            raise WireError(f"{raw[0]} has {len(values)} fields, needs {required}")
        return values + [None] * (len(names) - len(values))
    missing = [n for n in names[:required] if n not in raw]
    if missing:
        raise WireError(f"{raw['type']} lacks {', '.join(missing)}")
    return [raw.get(n) for n in names]


def _tag(raw: Any) -> str:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        return raw[0]
    if isinstance(raw, dict) and isinstance(raw.get("type"), str):
        return raw["type"]
    raise WireError("an event is a tagged array or a map with a type")


def _event(raw: Any) -> Event | None:
    tag = _tag(raw)
    if tag == _STORED:
        hashes, parent, tokens, size, _lora, medium = _fields(raw, _STORED_FIELDS, 4)
        if parent is not None and type(parent) not in (int, bytes):
            raise WireError(f"bad parent_block_hash {parent!r}")
        if type(size) is not int or size <= 0:
            raise WireError(f"bad block_size {size!r}")
        return Stored(_hashes(hashes), parent, _tokens(tokens), size, _medium(medium))
    if tag == _REMOVED:
        hashes, medium = _fields(raw, _REMOVED_FIELDS, 1)
        return Removed(_hashes(hashes), _medium(medium))
    if tag == _CLEARED:
        return Cleared()
    return None


def _hashes(raw: Any) -> list[BlockHash]:
    if not isinstance(raw, list) or not _HASH_TYPES.issuperset(map(type, raw)):
        raise WireError("block_hashes must be an array of ints or bytes")
    return raw


def _tokens(raw: Any) -> list[int]:
    if not isinstance(raw, list):
        raise WireError("token_ids must be an array")
    try:
        return msgspec.convert(raw, _TOKENS)  # checks every item at C speed
    except msgspec.ValidationError as exc:
        raise WireError(f"token_ids: {exc}") from None


def _medium(raw: Any) -> str | None:
    if raw is not None and not isinstance(raw, str):
        raise WireError(f"bad medium {raw!r}")
    return raw


def encode(batch: Batch) -> bytes:
    """``batch`` in vLLM's array-like form (what engines publish), for tests and benchmarks."""
    return _encoder.encode([batch.ts, [_raw(e) for e in batch.events], batch.dp_rank])


def _raw(event: Event) -> list[Any]:
    if isinstance(event, Stored):
        e = event
        return [_STORED, e.block_hashes, e.parent, list(e.token_ids), e.block_size, None, e.medium, None]
    if isinstance(event, Removed):
        return [_REMOVED, event.block_hashes, event.medium]
    return [_CLEARED]
