"""KeyRing: every stored form finds its owner and nothing else, malformed files are refused
without showing a key, and PBKDF2 checks are cached, shared and bounded."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from motor_mesh.common import apikeys
from motor_mesh.common.apikeys import KeyRing, hash_key
from tests.poll import until

KEY = "sk-motor-Q2x7hV9pLr4tWm8NcB3fJk6YsD1gHe5A"
OTHER = "sk-motor-Zp0oIu9yTr8eWq7AsD6fGh5JkL4zXc3V"
SECRET = "Hunter2Secret"  # in malformed entries: must never show in an error


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def pbkdf2_form(key: str, iterations: int = 1000, salt: bytes = b"salt-of-16-bytes") -> str:
    """The PBKDF2 form built from the grammar alone (and with few iterations, to be quick)."""
    derived = hashlib.pbkdf2_hmac("sha256", key.encode(), salt, iterations, 32)
    return f"pbkdf2_sha256${iterations}${b64(salt)}${b64(derived)}"


SALT = b64(b"0123456789abcdef")
HASH = b64(bytes(32))


@pytest.fixture
def pbkdf2_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the module's PBKDF2 rounds (one list item each, its iterations)."""
    calls: list[int] = []
    real = hashlib.pbkdf2_hmac

    def counted(name: str, password: bytes, salt: bytes, iterations: int, dklen: int | None = None) -> bytes:
        calls.append(iterations)
        return real(name, password, salt, iterations, dklen)

    monkeypatch.setattr(apikeys, "pbkdf2_hmac", counted)
    yield calls


def near_misses(key: str) -> list[bytes]:
    raw = key.encode()
    flipped = bytes([raw[-1] ^ 1])
    return [
        b"",
        OTHER.encode(),
        raw[:-1],  # a prefix
        raw[:8],
        raw[:-1] + flipped,  # one byte differs
        bytes([raw[0] ^ 1]) + raw[1:],
        raw + b"x",
        raw.upper(),
    ]


# -- each stored form ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["plain", "sha256"])
def test_fast_forms_find_their_owner_and_nothing_else(form: str) -> None:
    stored = KEY if form == "plain" else hash_key(KEY)
    ring = KeyRing([(stored, "alice")])
    assert ring.find(KEY.encode()) == "alice"
    assert not ring.needs_slow_check(KEY.encode())
    for miss in near_misses(KEY):
        assert ring.find(miss) is None, miss
        assert not ring.needs_slow_check(miss)


def test_sha256_form_is_the_hex_digest_of_the_utf8_bytes() -> None:
    assert hash_key(KEY) == "sha256:" + hashlib.sha256(KEY.encode()).hexdigest()
    unicode_key = "clé-à-moi"
    stored = "sha256:" + hashlib.sha256(unicode_key.encode()).hexdigest()
    assert KeyRing([(stored, 1)]).find(unicode_key.encode()) == 1
    assert KeyRing([(unicode_key, 1)]).find(unicode_key.encode()) == 1


async def test_pbkdf2_form_resolves_its_owner_and_nothing_else(pbkdf2_calls: list[int]) -> None:
    ring = KeyRing([(pbkdf2_form(KEY), "alice"), (OTHER, "bob")])
    assert ring.find(KEY.encode()) is None  # not checked yet
    assert ring.needs_slow_check(KEY.encode())
    assert await ring.resolve(KEY.encode()) == "alice"
    assert ring.find(KEY.encode()) == "alice"  # from the cache now
    assert await ring.resolve(OTHER.encode()) == "bob"  # a fast entry: no PBKDF2 round
    assert pbkdf2_calls == [1000]
    for miss in near_misses(KEY):
        if miss != OTHER.encode():
            assert await ring.resolve(miss) is None, miss
    assert not ring.needs_slow_check(b"")  # an empty key is never checked


async def test_hash_key_pbkdf2_makes_a_form_the_ring_accepts() -> None:
    stored = hash_key(KEY, "pbkdf2", iterations=100_000)
    assert re.fullmatch(r"pbkdf2_sha256\$100000\$[A-Za-z0-9_-]{22}\$[A-Za-z0-9_-]{43}", stored)
    assert hash_key(KEY, "pbkdf2", iterations=100_000) != stored  # a fresh salt each time
    ring = KeyRing([(stored, "alice")])
    assert await ring.resolve(KEY.encode()) == "alice"
    assert await ring.resolve(OTHER.encode()) is None


def test_hash_key_refuses_what_it_cannot_make_without_naming_the_key() -> None:
    for key, problem in [
        ("", "empty"),
        (f" {SECRET}", "whitespace"),
        (f"{SECRET} ", "whitespace"),
        (f"{SECRET}\t", "whitespace"),
        (f"{SECRET}\x00", "control characters"),
        (f"{SECRET}\x7f", "control characters"),
    ]:
        with pytest.raises(ValueError, match=problem) as err:
            hash_key(key)
        assert SECRET not in str(err.value)
    with pytest.raises(ValueError, match="unknown scheme"):
        hash_key(KEY, "md5")
    with pytest.raises(ValueError, match="iterations must be from 100000"):
        hash_key(KEY, "pbkdf2", iterations=99_999)
    with pytest.raises(ValueError, match="iterations must be from"):
        hash_key(KEY, "pbkdf2", iterations=10_000_001)


# -- what a file may hold -------------------------------------------------------------------------


def test_the_same_key_twice_for_one_owner_is_one_key() -> None:
    ring = KeyRing([(KEY, "alice"), (hash_key(KEY), "alice"), (KEY, "alice"), (OTHER, "bob")])
    assert len(ring) == 2
    assert ring.find(KEY.encode()) == "alice"
    stored = pbkdf2_form(KEY)
    assert len(KeyRing([(stored, "alice"), (stored, "alice")])) == 1


@pytest.mark.parametrize(
    "entries",
    [
        [(KEY, "alice"), (KEY, "bob")],
        [(KEY, "alice"), (OTHER, "carol"), (hash_key(KEY), "bob")],
        [(hash_key(KEY), "alice"), (KEY, "bob")],
        [(pbkdf2_form(KEY), "alice"), (pbkdf2_form(KEY), "bob")],
    ],
)
def test_one_key_for_two_owners_is_refused_without_showing_it(entries: list[tuple[str, str]]) -> None:
    with pytest.raises(ValueError, match=r"entries 1 and \d: the same key for different owners") as err:
        KeyRing(entries)
    message = str(err.value)
    assert KEY not in message
    assert all(stored not in message for stored, _ in entries)


@pytest.mark.parametrize(
    ("stored", "problem"),
    [
        ("", "the key is empty"),
        (f" {SECRET}", "starts or ends with whitespace"),
        (f"{SECRET}\t", "starts or ends with whitespace"),
        (f"{SECRET}\nmore", "control characters"),
        (f"sha256:{SECRET}", "64 lowercase hex digits"),
        ("sha256:" + hashlib.sha256(SECRET.encode()).hexdigest().upper(), "64 lowercase hex digits"),
        ("sha256:" + hashlib.sha256(SECRET.encode()).hexdigest() + "0", "64 lowercase hex digits"),
        ("sha256:" + hashlib.sha256(b"").hexdigest(), "the empty key"),
        (f"SHA256:{SECRET}", "looks hashed"),
        (f"sha256_{SECRET}", "looks hashed"),
        (f"pbkdf2_sha512$1000${SALT}${HASH}", "looks hashed"),
        (f"PBKDF2:{SECRET}", "looks hashed"),
        (f"pbkdf2_sha256${SECRET}", "pbkdf2 form must be"),
        (f"pbkdf2_sha256$1000${SALT}${HASH}${SECRET}", "pbkdf2 form must be"),
        (f"pbkdf2_sha256$1e6${SALT}${HASH}", "iterations must be a decimal"),
        (f"pbkdf2_sha256$01000${SALT}${HASH}", "iterations must be a decimal"),
        (f"pbkdf2_sha256$999${SALT}${HASH}", "from 1000 to 10000000"),
        (f"pbkdf2_sha256$10000001${SALT}${HASH}", "from 1000 to 10000000"),
        (f"pbkdf2_sha256$100000000000${SALT}${HASH}", "iterations must be a decimal"),
        (f"pbkdf2_sha256$1000${SALT}=${HASH}", "URL-safe base64 without padding"),
        (f"pbkdf2_sha256$1000${SALT}$/{HASH[1:]}", "URL-safe base64 without padding"),
        (f"pbkdf2_sha256$1000${SECRET}$A{HASH}", "URL-safe base64 without padding"),
        (f"pbkdf2_sha256$1000${SALT[:-1]}B${HASH}", "URL-safe base64 without padding"),  # not canonical
        (f"pbkdf2_sha256$1000${b64(b'short')}${HASH}", "salt must be 8 to 64 bytes"),
        (f"pbkdf2_sha256$1000${b64(bytes(65))}${HASH}", "salt must be 8 to 64 bytes"),
        (f"pbkdf2_sha256$1000${SALT}${b64(bytes(16))}", "hash must be 32 bytes"),
    ],
)
def test_malformed_forms_are_refused_naming_the_entry_not_the_key(stored: str, problem: str) -> None:
    with pytest.raises(ValueError) as err:
        KeyRing([(OTHER, "bob"), (stored, "alice")])
    message = str(err.value)
    assert message.startswith("entry 2: ")
    assert problem in message
    assert SECRET not in message and OTHER not in message
    assert not stored or stored not in message


def test_the_iteration_limits_are_inclusive() -> None:
    assert len(KeyRing([(pbkdf2_form(KEY, 1000), "a")])) == 1
    stored = f"pbkdf2_sha256$10000000${SALT}${HASH}"
    assert len(KeyRing([(stored, "a")])) == 1


def test_nothing_shows_a_key() -> None:
    ring = KeyRing([(KEY, "alice"), (pbkdf2_form(OTHER), "bob")])
    assert repr(ring) == str(ring) == "KeyRing(2 keys)"
    assert len(ring) == 2
    held = repr(vars(ring))  # digests and PBKDF2 hashes only: the key in clear is not kept
    assert KEY not in held and repr(KEY.encode())[2:-1] not in held


# -- many keys ------------------------------------------------------------------------------------


def test_a_thousand_sha256_entries_each_find_their_owner() -> None:
    keys = [f"sk-motor-{i:04d}-{hashlib.sha256(str(i).encode()).hexdigest()[:32]}" for i in range(1000)]
    ring = KeyRing([(hash_key(k), i) for i, k in enumerate(keys)] + [("a-plain-one", -1)])
    assert len(ring) == 1001
    for i, k in enumerate(keys):
        assert ring.find(k.encode()) == i
        assert ring.find(k.encode()[:-1]) is None
    assert ring.find(b"a-plain-one") == -1


# -- the PBKDF2 check -----------------------------------------------------------------------------


async def test_an_answer_is_cached_right_or_wrong(pbkdf2_calls: list[int]) -> None:
    ring = KeyRing([(pbkdf2_form(KEY), "alice"), (pbkdf2_form(OTHER, 2000), "bob")])
    assert await ring.resolve(KEY.encode()) == "alice"
    assert pbkdf2_calls == [1000, 2000]  # every entry is tried, the match first or not
    assert await ring.resolve(KEY.encode()) == "alice"
    assert ring.find(KEY.encode()) == "alice"
    assert len(pbkdf2_calls) == 2

    wrong = b"sk-motor-not-a-key"
    for _ in range(5):
        assert await ring.resolve(wrong) is None
    assert len(pbkdf2_calls) == 4  # one check for the flood of one wrong key
    assert not ring.needs_slow_check(wrong)
    assert ring.find(wrong) is None


async def test_concurrent_resolves_of_one_key_share_one_check(pbkdf2_calls: list[int]) -> None:
    ring = KeyRing([(pbkdf2_form(KEY), "alice")])
    answers = await asyncio.gather(*(ring.resolve(KEY.encode()) for _ in range(20)))
    assert answers == ["alice"] * 20
    assert pbkdf2_calls == [1000]
    wrong = await asyncio.gather(*(ring.resolve(b"sk-wrong") for _ in range(20)))
    assert wrong == [None] * 20
    assert pbkdf2_calls == [1000, 1000]


async def test_a_cancelled_caller_does_not_cancel_the_shared_check(monkeypatch: pytest.MonkeyPatch) -> None:
    release, entered = threading.Event(), threading.Event()
    real = hashlib.pbkdf2_hmac

    def slow(name: str, password: bytes, salt: bytes, iterations: int, dklen: int | None = None) -> bytes:
        entered.set()
        release.wait(10)
        return real(name, password, salt, iterations, dklen)

    monkeypatch.setattr(apikeys, "pbkdf2_hmac", slow)
    ring = KeyRing([(pbkdf2_form(KEY), "alice")])
    first = asyncio.create_task(ring.resolve(KEY.encode()))
    second = asyncio.create_task(ring.resolve(KEY.encode()))
    await until(entered.is_set, 10, "the shared check to start")  # both callers wait on it now
    first.cancel()
    release.set()
    assert await second == "alice"
    with pytest.raises(asyncio.CancelledError):
        await first
    assert ring.find(KEY.encode()) == "alice"


async def test_a_key_two_pbkdf2_owners_accept_is_refused(pbkdf2_calls: list[int]) -> None:
    ring = KeyRing([(pbkdf2_form(KEY, salt=b"first-salt-bytes"), "a"), (pbkdf2_form(KEY), "b")])
    assert len(ring) == 2
    assert await ring.resolve(KEY.encode()) is None
    same = KeyRing([(pbkdf2_form(KEY, salt=b"first-salt-bytes"), "a"), (pbkdf2_form(KEY), "a")])
    assert await same.resolve(KEY.encode()) == "a"


async def test_a_fast_entry_wins_over_a_pbkdf2_entry_of_the_same_key(pbkdf2_calls: list[int]) -> None:
    ring = KeyRing([(pbkdf2_form(KEY), "slow"), (hash_key(KEY), "fast")])
    assert not ring.needs_slow_check(KEY.encode())
    assert await ring.resolve(KEY.encode()) == "fast"
    assert pbkdf2_calls == []


async def test_wrong_keys_remembered_are_bounded_and_the_proven_stay(
    monkeypatch: pytest.MonkeyPatch, pbkdf2_calls: list[int]
) -> None:
    monkeypatch.setattr(apikeys, "_REFUSED_CACHE", 3)
    ring = KeyRing([(pbkdf2_form(KEY), "alice")])
    assert await ring.resolve(KEY.encode()) == "alice"
    for i in range(5):
        assert await ring.resolve(f"wrong-{i}".encode()) is None
    assert not ring.needs_slow_check(b"wrong-4")
    assert ring.needs_slow_check(b"wrong-0")  # the oldest went
    assert ring.find(KEY.encode()) == "alice"  # not evicted by wrong keys
    assert len(pbkdf2_calls) == 6


async def test_only_a_few_checks_run_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    running, most = 0, 0
    lock = threading.Lock()
    real: Callable[..., bytes] = hashlib.pbkdf2_hmac

    def tracked(name: str, password: bytes, salt: bytes, iterations: int, dklen: int | None = None) -> bytes:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        return real(name, password, salt, iterations, dklen)

    monkeypatch.setattr(apikeys, "pbkdf2_hmac", tracked)
    ring = KeyRing([(pbkdf2_form(KEY), "alice")])
    keys = [KEY.encode()] + [f"wrong-{i}".encode() for i in range(7)]
    answers = await asyncio.gather(*(ring.resolve(k) for k in keys))
    assert answers == ["alice"] + [None] * 7
    assert most == apikeys._SLOW_AT_ONCE
