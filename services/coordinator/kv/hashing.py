"""Motor's own chained hashes of token blocks: the keys of the KV index and of a prompt's lookup.

An engine names its cached blocks with hashes a router cannot recompute (vLLM's are SHA-256
seeded per process), but its events carry each block's tokens and its parent. So the index keys
every block by a hash of (the parent block's hash, the block's tokens), computed here both from
the events and from a prompt's tokens: a prompt's i-th hash equals a cached block's exactly when
the first i + 1 blocks of tokens are the same.

The contract (docs/kv-routing.md, "Block keys"), the same in every process, Python version and
machine:

- a block is ``block_size`` token ids, each written as a 64-bit signed little-endian integer
  (the width the engines' events carry them in, so an event's ids are hashed where they lie;
  ids outside that range have no key: such a prompt is routed by load alone);
- its key is XXH3-64 of those bytes, seeded with its parent's key (unsigned), the first block's
  parent being :data:`ROOT`;
- the index stores a key as the signed 64-bit integer with the same bits.

XXH3 is a well-kept, fast, non-cryptographic hash (the ``xxhash`` package, 0.16 µs a block
here). A prompt crafted to collide with another's blocks can at worst steer its own request to a
worse engine.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

# The "parent" of a sequence's first block: an arbitrary constant ("MOTOR" in ASCII).
ROOT = 0x4D4F544F52
_WRAP = 1 << 64
_BIG_ENDIAN = sys.byteorder == "big"


def chain(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> array[int]:
    """The keys of ``tokens``' full blocks of ``block_size`` (a trailing partial block has
    none), the first one chained to ``parent`` (a key, signed or not). Raises OverflowError for
    an id outside the signed 64-bit range."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    ids = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
    if _BIG_ENDIAN:
        ids = array("q", ids)
        ids.byteswap()
    raw = memoryview(ids).cast("B")
    step = block_size * 8
    out = array("Q")
    add = out.append
    h = parent % _WRAP
    for start in range(0, len(raw) - step + 1, step):
        h = xxh3_64_intdigest(raw[start : start + step], h)
        add(h)
    signed = array("q")
    signed.frombytes(out.tobytes())
    return signed
