"""Where the real tokenizers `make tokenizers` fetches are (tools/fetch_tokenizers.py).

``llama3_dir()`` for tests (skips without the files), ``llama3_path()`` for benches (None
without them): Llama 3's ``tokenizer.json`` and ``tokenizer_config.json`` (its chat template) in
``.tokenizers/llama3`` at the repo root. Fetched, never committed (Llama 3 Community License).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA3 = REPO / ".tokenizers" / "llama3"
FILES = ("tokenizer.json", "tokenizer_config.json")


def llama3_path() -> str | None:
    """The Llama 3 tokenizer's directory, or None when `make tokenizers` could not fetch it."""
    return str(LLAMA3) if all((LLAMA3 / name).is_file() for name in FILES) else None


def llama3_dir() -> str:
    """The Llama 3 tokenizer's directory; skips the test without it."""
    path = llama3_path()
    if path is None:
        import pytest  # only here: benches import this module without pytest

        pytest.skip("no Llama 3 tokenizer in .tokenizers/llama3 (make tokenizers fetches it)")
    return path
