"""KV event batches on the wire, fuzzed: any bytes or msgpack value decodes to a batch that
round-trips or raises WireError (never another exception), and the typed decoding path (vLLM's
form) reads exactly what the generic path reads. The worked examples are in
tests/coordinator/test_kv_wire.py."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.coordinator.kv import wire
from motor_mesh.coordinator.kv.wire import Batch, WireError, decode, encode

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "ts", "events"]),
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(
            st.sampled_from(["type", "ts", "events", "block_hashes", "token_ids", "x"]), children
        )
    ),
    max_leaves=40,
)
event_like = st.lists(
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]).map(lambda t: [t]),
    max_size=1,
).flatmap(lambda head: st.lists(msgpack_values, max_size=9).map(lambda rest: head + rest))
batch_like = st.tuples(
    st.floats() | st.integers(0, 10), st.lists(event_like, max_size=4), msgpack_values
).map(list)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_bytes_decode_or_wire_error(payload: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(payload)


@settings(max_examples=500, deadline=None)
@given(msgpack_values | batch_like)
def test_fuzz_values_decode_or_wire_error(value: Any) -> None:
    try:
        batch = decode(msgspec.msgpack.encode(value))
    except WireError:
        return
    assert isinstance(batch, Batch)
    assert decode(encode(batch)) == batch


hashes = st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(min_size=1, max_size=32), max_size=6)
vllm_event = st.one_of(
    st.tuples(
        st.just("BlockStored"),
        hashes,
        st.none() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=32),
        # Token ids past 2**63 - 1 (no engine's) go the generic way, which reads them too.
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20),
        st.integers(1, 64),
        st.none() | st.integers(0, 9),
        st.none() | st.sampled_from(["GPU", "CPU"]),
        st.none() | st.text(max_size=4),
    ),
    st.tuples(st.just("BlockRemoved"), hashes, st.none() | st.just("GPU")),
    st.just(("AllBlocksCleared",)),
).map(list)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 2**40), st.lists(vllm_event, max_size=5)
)
def test_vllms_form_takes_the_typed_path_to_the_same_batch(ts: float, events: list[Any]) -> None:
    payload = msgspec.msgpack.encode([ts, events, 0])
    typed = wire._decode_typed(payload)
    assert typed is not None
    assert typed == wire._decode_any(payload)


@settings(max_examples=500, deadline=None)
@given(msgpack_values | batch_like)
def test_whatever_the_typed_path_takes_it_reads_as_the_generic_path_does(value: Any) -> None:
    payload = msgspec.msgpack.encode(value)
    typed = wire._decode_typed(payload)
    if typed is not None:
        assert typed == wire._decode_any(payload)
