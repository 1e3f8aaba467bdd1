"""Hypothesis strategies built from protobuf descriptors, so every field of every request (and
every field a later proto adds) is fuzzed without a hand-written strategy.

- :func:`messages`: messages of any type. Integers at their type's extremes, empty / huge /
  unicode / control-character strings, repeated fields with many elements, nested messages,
  maps, one field of each oneof, and enums with numbers the proto does not define. With
  ``seeds`` (plausible requests), a share of the examples are a seed with generated fields
  merged in, which gets past the first "required" check and reaches deeper code.
- :func:`wire_bytes`: bytes that are not a valid encoding of the message, or are one only by
  accident: random bytes, truncated and corrupted encodings of generated messages, and crafted
  wire fragments (wrong wire types, runaway varints, lengths past the end, invalid UTF-8 in
  string fields, unterminated and deeply nested groups).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor

HUGE_STRING = 100_000  # characters: far past any sane name, well under the 4 MiB message limit
MANY = (64, 1001, 4096)  # element counts of "many" repeated fields (1001: past a 1000 cap)
CONTROL = "\x00\x01\x07\x08\t\n\r\x1b\x7f\x85\u2028\u2029\u202e\ufeff\ufffd"

_INT_RANGES: dict[int, tuple[int, int]] = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Extremes and their neighbours first-class, then small and arbitrary values."""
    edges = sorted({v for v in (lo, lo + 1, -1, 0, 1, 2, 65535, 65536, hi // 2, hi // 2 + 1, hi - 1, hi)
                    if lo <= v <= hi})  # fmt: skip
    return st.one_of(
        st.sampled_from(edges), st.integers(0, 64).filter(lambda v: lo <= v <= hi), st.integers(lo, hi)
    )


def strings(small: bool = False) -> st.SearchStrategy[str]:
    sizes = [16] if small else [4096, HUGE_STRING]
    return st.one_of(
        st.just(""),
        st.text(max_size=24),  # any code point but surrogates (protobuf refuses those itself)
        st.text(alphabet=st.sampled_from(CONTROL + "ab:/. "), max_size=24),
        st.sampled_from(["127.0.0.1", "::1", "[::1]", "localhost", "0.0.0.0", "host:7300", "a" * 256]),
        st.tuples(st.sampled_from(["x", "é", "\U0001f600", "\x00", "%s{}"]), st.sampled_from(sizes)).map(
            lambda t: t[0] * (t[1] // len(t[0]))
        ),
    )


def _binary(small: bool) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=32), st.just(b"\xff" * (16 if small else HUGE_STRING)))


def _scalar(field: FieldDescriptor, small: bool = False) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        return integers(*_INT_RANGES[t])
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == F.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == F.TYPE_STRING:
        return strings(small)
    if t == F.TYPE_BYTES:
        return _binary(small)
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        # Open enums (proto3) keep numbers they do not define: a peer on a newer proto sends them.
        return st.one_of(st.sampled_from(known), integers(-(2**31), 2**31 - 1))
    raise AssertionError(f"no strategy for field type {t} ({field.full_name})")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry and field.is_repeated


def _repeated(
    field: FieldDescriptor, depth: int, max_depth: int, small: bool
) -> st.SearchStrategy[Any] | None:
    element = _element(field, depth, max_depth, small)
    if element is None:
        return None
    few = st.lists(element, max_size=2 if small else 3)
    if small:
        return few
    # Many copies of one small element: the count is what is being tried, not the bytes.
    tiny = _element(field, depth, max_depth, True)
    assert tiny is not None
    many = st.tuples(tiny, st.sampled_from(MANY)).map(lambda t: [t[0]] * t[1])
    return st.one_of(few, many)


def _element(
    field: FieldDescriptor, depth: int, max_depth: int, small: bool
) -> st.SearchStrategy[Any] | None:
    if field.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
        return _message(field.message_type, depth + 1, max_depth, small)
    return _scalar(field, small)


def _value(field: FieldDescriptor, depth: int, max_depth: int, small: bool) -> st.SearchStrategy[Any] | None:
    if _is_map(field):
        entry = field.message_type
        key = _scalar(entry.fields_by_name["key"], small)
        value = _element(entry.fields_by_name["value"], depth, max_depth, small)
        if value is None:
            return None
        return st.dictionaries(key, value, max_size=2 if small else 3)
    if field.is_repeated:
        return _repeated(field, depth, max_depth, small)
    return _element(field, depth, max_depth, small)


def _assign(msg: Message, field: FieldDescriptor, value: Any) -> None:
    name = field.name
    if _is_map(field):
        target = getattr(msg, name)
        for k, v in value.items():
            if isinstance(v, Message):
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        getattr(msg, name).extend(value)
    elif field.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
        getattr(msg, name).CopyFrom(value)
    else:
        setattr(msg, name, value)


def _message(
    desc: Descriptor, depth: int, max_depth: int, small: bool = False
) -> st.SearchStrategy[Message] | None:
    if depth > max_depth:
        return None  # the field stays unset
    cls = message_factory.GetMessageClass(desc)
    in_oneof = {f.name for o in desc.oneofs for f in o.fields}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        if field.name in in_oneof:
            continue
        s = _value(field, depth, max_depth, small)
        if s is not None:
            optional[field.name] = s
    oneofs: list[st.SearchStrategy[tuple[str, Any] | None]] = []
    for oneof in desc.oneofs:
        choices = []
        for f in oneof.fields:
            s = _value(f, depth, max_depth, small)
            if s is not None:
                choices.append(st.tuples(st.just(f.name), s))
        if choices:
            oneofs.append(st.one_of(st.none(), *choices))

    def build(parts: tuple[dict[str, Any], list[tuple[str, Any] | None]]) -> Message:
        plain, chosen = parts
        msg = cls()
        for name, value in plain.items():
            _assign(msg, desc.fields_by_name[name], value)
        for pick in chosen:
            if pick is not None:
                _assign(msg, desc.fields_by_name[pick[0]], pick[1])
        return msg

    return st.tuples(st.fixed_dictionaries({}, optional=optional), st.tuples(*oneofs).map(list)).map(build)


def messages(
    desc: Descriptor, seeds: Sequence[Message] = (), max_depth: int = 3
) -> st.SearchStrategy[Message]:
    """Messages of type ``desc``; with ``seeds``, also seeds with generated fields merged in
    (``MergeFrom``: set scalars replace, repeated fields grow, messages merge)."""
    plain = _message(desc, 0, max_depth)
    assert plain is not None
    if not seeds:
        return plain

    def mutate(parts: tuple[Message, Message, bool]) -> Message:
        seed, extra, clear_first = parts
        msg = type(seed)()
        msg.CopyFrom(seed)
        if clear_first and extra.ListFields():
            # Unset what the generated part sets, so a default (0, "", empty) can replace a
            # seed's value: MergeFrom alone never writes a default.
            for field, _ in extra.ListFields():
                msg.ClearField(field.name)
        msg.MergeFrom(extra)
        return msg

    seeded = st.tuples(st.sampled_from(list(seeds)), plain, st.booleans()).map(mutate)
    return st.one_of(plain, seeded, st.sampled_from(list(seeds)))


# -- wire-level garbage ---------------------------------------------------------------------------


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (negative numbers as their 64-bit two's complement)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint((number << 3) | wire_type)


def _fragments(desc: Descriptor) -> list[bytes]:
    """Hand-made encodings that are wrong in one precise way, for the fields ``desc`` has."""
    out = [
        b"\x80" * 11,  # a varint that never ends
        b"\xff" * 10 + b"\x01",  # a varint past 64 bits
        tag(536870911, 0) + b"\x01",  # the largest field number
        b"\x00\x01",  # field number 0
        tag(7, 3) * 5000,  # groups opened and never closed, nested past any recursion limit
        tag(7, 4),  # a group closed that was never opened
        tag(7, 6) + b"\x00",  # wire type 6 and 7 do not exist
        tag(7, 7) + b"\x00",
        tag(9, 2) + varint(2**31),  # a length far past the end
        tag(9, 2) + varint(2**64 - 1),
        tag(9, 5) + b"\x00\x00",  # fixed32 cut short
        tag(9, 1) + b"\x00" * 3,  # fixed64 cut short
    ]
    for field in desc.fields:
        n = field.number
        if field.type == F.TYPE_STRING:
            out.append(tag(n, 2) + b"\x04\xff\xfe\xc0\x80")  # not UTF-8: proto3 refuses it
            out.append(tag(n, 2) + b"\x03\xed\xa0\x80")  # an encoded surrogate
        if field.type in (F.TYPE_MESSAGE, F.TYPE_GROUP):
            # A message field holding itself-shaped bytes nested deeper than any parser allows.
            nested = b""
            for _ in range(200):
                nested = tag(n, 2) + varint(len(nested)) + nested
            out.append(nested)
            out.append(tag(n, 2) + b"\x05\x80\x80\x80")  # an inner message that is cut short
        # The field's number with each wrong wire type.
        for wt in (0, 1, 2, 5):
            out.append(tag(n, wt) + (b"\x05ab" if wt == 2 else b""))
    return out


def wire_bytes(desc: Descriptor, valid: st.SearchStrategy[Message] | None = None) -> st.SearchStrategy[bytes]:
    """Bytes to send as a request of type ``desc`` (mostly invalid encodings)."""
    valid = valid if valid is not None else messages(desc, max_depth=2)
    encoded = valid.map(lambda m: m.SerializeToString())

    def corrupt(parts: tuple[bytes, int, int, bytes]) -> bytes:
        data, pos, op, junk = parts
        if not data:
            return junk
        pos %= len(data)
        if op == 0:
            return data[:pos]  # truncated
        if op == 1:
            return data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1 :]  # a byte flipped
        if op == 2:
            return data[:pos] + junk + data[pos:]  # garbage inserted
        return data + junk  # garbage appended

    frags = _fragments(desc)
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from(frags),
        st.lists(st.sampled_from(frags), min_size=2, max_size=4).map(b"".join),
        st.tuples(encoded, st.integers(0, 2**16), st.integers(0, 3), st.binary(min_size=1, max_size=8)).map(
            corrupt
        ),
    )


def parses(cls: Callable[[bytes], Message], raw: bytes) -> bool:
    """Whether ``raw`` is a valid encoding for ``cls`` (``Type.FromString``)."""
    try:
        cls(raw)
    except Exception:
        return False
    return True
