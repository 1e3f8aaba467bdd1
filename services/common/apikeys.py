"""Client API keys: the forms they are stored in, and whose key a request presents
(``Authorization: Bearer <key>``).

Stored forms, one string per key (:func:`hash_key` and ``motor keys hash`` make the hashed ones):

- ``<key>``: the key itself, in clear;
- ``sha256:<64 lowercase hex digits>``: SHA-256 of the key's UTF-8 bytes;
- ``pbkdf2_sha256$<iterations>$<salt>$<hash>``: PBKDF2-HMAC-SHA256 of the key's UTF-8 bytes.
  ``iterations`` is a decimal from 1,000 to 10,000,000 (:func:`hash_key` makes no fewer than
  100,000); ``salt`` (8 to 64 bytes) and ``hash`` (32 bytes) are URL-safe base64 without
  padding (``A-Z a-z 0-9 - _``, no ``=``).

A string that starts with ``sha256`` or ``pbkdf2`` (in any case) followed by ``:``, ``$`` or
``_`` must be one of the hashed forms: a mistyped hash then fails the load instead of quietly
becoming a key in clear whose text is the typo.

sha256 is the form for API keys. They are random (``motor keys new``: 256 bits), and nobody can
search 2^256 inputs for one whose digest is in a leaked file, fast hash or not. A slow hash such
as PBKDF2 protects secrets that people choose, which a leaked file would otherwise let an
attacker guess at billions a second from a dictionary. Here it has a price: a PBKDF2 hash cannot
be looked up, so the first request with each key, right or wrong, costs one PBKDF2 round per
PBKDF2 entry (about 0.15 s of a core each at 600,000 iterations), again in every process and
after every reload. Answers are cached, so one key, right or wrong, costs that once; but every
distinct wrong key costs it anew, and a client sending many can make the first requests of real
PBKDF2 keys wait. Only ``_SLOW_AT_ONCE`` such checks run at a time, so they cannot fill the
default executor that other ``to_thread`` work shares.

Timing: a presented key is hashed once with SHA-256 and the digest looked up in a dict of the
digests of the clear and sha256 entries, then confirmed with :func:`hmac.compare_digest`. No
byte of a presented key is compared with a stored key, so a guess that has the first bytes of a
real key right is not answered any faster or slower than a guess that does not. The PBKDF2
check always tries every PBKDF2 entry, so its time does not say which one matched.

Keys in clear are not kept: the ring holds digests and PBKDF2 hashes only, and neither its repr
nor its errors show any of them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import re
import secrets
from collections import OrderedDict
from collections.abc import Iterable
from hashlib import pbkdf2_hmac, sha256
from typing import Generic, TypeVar

T = TypeVar("T")

SHA256_PREFIX = "sha256:"
PBKDF2_PREFIX = "pbkdf2_sha256$"
# What a stored form may ask for: fewer is too weak to be worth the form, more would let one
# line of a file stall each new key for minutes.
MIN_ITERATIONS = 1_000
MAX_ITERATIONS = 10_000_000
# What hash_key makes: OWASP's 2023 figure for PBKDF2-HMAC-SHA256 as the default, and never
# below MIN_HASH_ITERATIONS.
DEFAULT_ITERATIONS = 600_000
MIN_HASH_ITERATIONS = 100_000
SALT_BYTES = 16
_SALT_RANGE = (8, 64)
_HASH_BYTES = 32
# Wrong keys remembered after a PBKDF2 check (a flood of one wrong key costs one round). Keys
# that passed are kept apart and never evicted by wrong ones: each PBKDF2 entry admits one key
# (two when it is longer than 64 bytes, as HMAC hashes such keys first), so they are few.
_REFUSED_CACHE = 10_000
# PBKDF2 checks running at once, each in a thread of the default executor.
_SLOW_AT_ONCE = 2

_HEX64 = re.compile(r"[0-9a-f]{64}")
_ITERATIONS = re.compile(r"[1-9][0-9]{0,7}")
_B64 = re.compile(r"[A-Za-z0-9_-]+")
_HASHED = re.compile(r"(?i)(sha256|pbkdf2)[:$_]")
_EMPTY_DIGEST = sha256(b"").digest()


class _Slow(Generic[T]):
    """A PBKDF2 entry. No repr: it would show the hash."""

    __slots__ = ("hash", "iterations", "owner", "salt")

    def __init__(self, iterations: int, salt: bytes, hashed: bytes, owner: T) -> None:
        self.iterations = iterations
        self.salt = salt
        self.hash = hashed
        self.owner = owner


class KeyRing(Generic[T]):
    """Stored keys and their owners (a tenant, a name: anything). Built once from a file's
    entries; to change them, build a new ring.

    On a request: ``owner = ring.find(key)``, and when that is None and
    ``ring.needs_slow_check(key)``, ``owner = await ring.resolve(key)`` (or always ``await
    ring.resolve(key)``, which does both). ``key`` is the presented key's bytes.
    """

    def __init__(self, entries: Iterable[tuple[str, T]]) -> None:
        """Raises ValueError naming the entry ("entry 3", counting from 1) when a stored form is
        malformed, or when two entries hold the same key for different owners (a clear key and
        its sha256 form are the same key). The same key for the same owner twice is allowed.

        Whether a PBKDF2 entry holds the same key as another entry cannot be told without the
        key. The other entry's owner wins; a key that two PBKDF2 entries of different owners
        accept is refused (:meth:`resolve`)."""
        # digest → (digest, owner): the value's digest is what compare_digest confirms against.
        self._fast: dict[bytes, tuple[bytes, T]] = {}
        # A PBKDF2 entry by its fields: the same string twice is one entry.
        slow: dict[tuple[int, bytes, bytes], _Slow[T]] = {}
        first: dict[bytes | tuple[int, bytes, bytes], int] = {}  # where each key was first seen
        for number, (stored, owner) in enumerate(entries, 1):
            try:
                parsed = _parse(stored, owner)
            except ValueError as exc:
                raise ValueError(f"entry {number}: {exc}") from None
            form: bytes | tuple[int, bytes, bytes]
            if isinstance(parsed, _Slow):
                form = fields = (parsed.iterations, parsed.salt, parsed.hash)
                held = slow.setdefault(fields, parsed).owner
            else:
                form = parsed
                held = self._fast.setdefault(parsed, (parsed, owner))[1]
            seen = first.setdefault(form, number)
            if held != owner:
                raise ValueError(f"entries {seen} and {number}: the same key for different owners")
        self._slow = list(slow.values())
        # SHA-256 of keys that passed a PBKDF2 check, and of keys that failed it (LRU).
        self._proven: dict[bytes, tuple[bytes, T]] = {}
        self._refused: OrderedDict[bytes, None] = OrderedDict()
        self._pending: dict[bytes, asyncio.Task[T | None]] = {}
        self._slots = asyncio.Semaphore(_SLOW_AT_ONCE)  # binds to a loop only when one waits

    def __len__(self) -> int:
        """Distinct stored keys (an entry repeated for the same owner counts once)."""
        return len(self._fast) + len(self._slow)

    def __repr__(self) -> str:
        return f"KeyRing({len(self)} keys)"

    def find(self, given: bytes) -> T | None:
        """The owner of ``given``, or None: unknown, empty, or a key only a PBKDF2 check can
        tell that has not had one yet (:meth:`needs_slow_check`). A few microseconds whatever
        the number of entries."""
        if not given:
            return None
        digest = sha256(given).digest()
        held = self._fast.get(digest)
        if held is None:
            if not self._slow:
                return None
            held = self._proven.get(digest)
            if held is None:
                if digest in self._refused:
                    self._refused.move_to_end(digest)
                return None
        return held[1] if hmac.compare_digest(held[0], digest) else None

    def needs_slow_check(self, given: bytes) -> bool:
        """Whether only :meth:`resolve` can tell the owner of ``given``: there are PBKDF2
        entries and this key has not been checked against them yet."""
        if not self._slow or not given:
            return False
        digest = sha256(given).digest()
        return digest not in self._fast and digest not in self._proven and digest not in self._refused

    async def resolve(self, given: bytes) -> T | None:
        """The owner of ``given``, or None, checking the PBKDF2 entries when :meth:`find`
        cannot tell. The answer is remembered, wrong keys too; concurrent calls for one key
        share one check, and cancelling a caller does not cancel the check."""
        if not self.needs_slow_check(given):
            return self.find(given)
        digest = sha256(given).digest()
        task = self._pending.get(digest)
        if task is None:
            task = asyncio.create_task(self._check(given, digest))
            self._pending[digest] = task
            task.add_done_callback(lambda done: self._forget(digest, done))
        return await asyncio.shield(task)

    async def _check(self, given: bytes, digest: bytes) -> T | None:
        async with self._slots:
            owner = await asyncio.to_thread(self._verify, given)
        if owner is None:
            self._refused[digest] = None
            if len(self._refused) > _REFUSED_CACHE:
                self._refused.popitem(last=False)
        else:
            self._proven[digest] = (digest, owner)
        return owner

    def _forget(self, digest: bytes, done: asyncio.Task[T | None]) -> None:
        if self._pending.get(digest) is done:
            del self._pending[digest]

    def _verify(self, given: bytes) -> T | None:
        """In a worker thread (pbkdf2_hmac releases the GIL): every entry is tried, so the time
        does not tell which one matched. Two matching entries of different owners: None."""
        owners: list[T] = []
        for entry in self._slow:
            derived = pbkdf2_hmac("sha256", given, entry.salt, entry.iterations, len(entry.hash))
            if hmac.compare_digest(derived, entry.hash):
                owners.append(entry.owner)
        if not owners or any(o != owners[0] for o in owners[1:]):
            return None
        return owners[0]


def hash_key(key: str, scheme: str = "sha256", iterations: int = DEFAULT_ITERATIONS) -> str:
    """The stored form of ``key``: ``scheme`` "sha256", or "pbkdf2" with ``iterations`` (from
    100,000 to 10,000,000) and a fresh 16-byte salt. Raises ValueError for an unusable key or
    arguments; the message never holds the key."""
    if problem := _key_problem(key):
        raise ValueError(problem)
    data = key.encode()
    if scheme == "sha256":
        return SHA256_PREFIX + sha256(data).hexdigest()
    if scheme != "pbkdf2":
        raise ValueError(f"unknown scheme {scheme!r} (sha256 or pbkdf2)")
    if not MIN_HASH_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be from {MIN_HASH_ITERATIONS} to {MAX_ITERATIONS}")
    salt = secrets.token_bytes(SALT_BYTES)
    hashed = pbkdf2_hmac("sha256", data, salt, iterations, _HASH_BYTES)
    return f"{PBKDF2_PREFIX}{iterations}${_b64(salt)}${_b64(hashed)}"


def _key_problem(key: str) -> str | None:
    """What makes ``key`` one no request can present (the server strips spaces and tabs off
    the header value, and header values hold no control characters), or None. Never includes
    the key."""
    if not key:
        return "the key is empty"
    if key != key.strip(" \t"):
        return "the key starts or ends with whitespace"
    if any(c < " " or c == "\x7f" for c in key):
        return "the key holds control characters"
    return None


def _parse(stored: str, owner: T) -> bytes | _Slow[T]:
    """A digest (clear and sha256 entries) or a PBKDF2 entry. ValueError says what is wrong,
    never the text."""
    if not isinstance(stored, str):
        raise ValueError("a stored key must be a string")
    if stored.startswith(SHA256_PREFIX):
        if not _HEX64.fullmatch(hexed := stored[len(SHA256_PREFIX) :]):
            raise ValueError("sha256 form must be 'sha256:' and 64 lowercase hex digits")
        digest = bytes.fromhex(hexed)
        if digest == _EMPTY_DIGEST:
            raise ValueError("sha256 form of the empty key")
        return digest
    if stored.startswith(PBKDF2_PREFIX):
        return _parse_pbkdf2(stored[len(PBKDF2_PREFIX) :], owner)
    if _HASHED.match(stored):
        raise ValueError(
            "looks hashed but is neither 'sha256:<hex>' nor 'pbkdf2_sha256$<iterations>$<salt>$<hash>'"
        )
    if problem := _key_problem(stored):
        raise ValueError(problem)
    return sha256(stored.encode()).digest()


def _parse_pbkdf2(fields: str, owner: T) -> _Slow[T]:
    parts = fields.split("$")
    if len(parts) != 3:
        raise ValueError("pbkdf2 form must be 'pbkdf2_sha256$<iterations>$<salt>$<hash>'")
    iterations_text, salt_text, hash_text = parts
    if not _ITERATIONS.fullmatch(iterations_text):
        raise ValueError("pbkdf2 iterations must be a decimal number")
    iterations = int(iterations_text)
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"pbkdf2 iterations must be from {MIN_ITERATIONS} to {MAX_ITERATIONS}")
    salt, hashed = _unb64(salt_text), _unb64(hash_text)
    if salt is None or hashed is None:
        raise ValueError("pbkdf2 salt and hash must be URL-safe base64 without padding")
    if not _SALT_RANGE[0] <= len(salt) <= _SALT_RANGE[1]:
        raise ValueError(f"pbkdf2 salt must be {_SALT_RANGE[0]} to {_SALT_RANGE[1]} bytes")
    if len(hashed) != _HASH_BYTES:
        raise ValueError(f"pbkdf2 hash must be {_HASH_BYTES} bytes")
    return _Slow(iterations, salt, hashed, owner)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes | None:
    """The bytes of canonical URL-safe base64 without padding, else None."""
    if not _B64.fullmatch(text):
        return None
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None
    return data if _b64(data) == text else None  # one spelling per value
