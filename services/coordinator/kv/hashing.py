"""Motor's own chained hashes of token blocks: the keys of the KV index and of a prompt's lookup.

An engine names its cached blocks with hashes a router cannot recompute (vLLM's are SHA-256
seeded per process), but its events carry each block's tokens and its parent. So the index keys
every block by a hash of (the parent block's hash, the block's tokens), computed here both from
the events and from a prompt's tokens: a prompt's i-th hash equals a cached block's exactly when
the first i + 1 blocks of tokens are the same.

The hash is Python's own ``hash`` of an ``(int, tuple of ints)`` tuple. It is the fastest chain
Python offers (the tuple hash runs in C over the ints' hashes) and it is the same in every
process: only str, bytes and datetime hashes are salted per process (PYTHONHASHSEED); an int
hashes to its value modulo the Mersenne prime 2**61 - 1 and a tuple combines its items' hashes
with a fixed xxHash-style round, so the Coordinator's processes and a restarted one all agree
(on the 64-bit builds Motor runs on). It is not a cryptographic hash: a prompt crafted to collide
with another's blocks can at worst steer its own request to a worse engine.
"""

from __future__ import annotations

from collections.abc import Sequence

# The "parent" of a sequence's first block: an arbitrary constant ("MOTOR" in ASCII).
ROOT = 0x4D4F544F52


def chain(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The chained hashes of ``tokens``' full blocks of ``block_size`` (a trailing partial block
    has none), the first one chained to ``parent``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    # One tuple up front: each block is then a slice made in C, hashable as is.
    t = tokens if type(tokens) is tuple else tuple(tokens)
    out: list[int] = []
    add = out.append
    h = parent
    for end in range(block_size, len(t) + 1, block_size):
        h = hash((h, t[end - block_size : end]))
        add(h)
    return out
