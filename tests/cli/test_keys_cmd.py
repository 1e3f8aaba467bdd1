"""``motor keys hash`` and ``motor keys new``: the key comes in on stdin only, what is printed
parses back through KeyRing to that key, and mistakes get one line and exit 1."""

from __future__ import annotations

import io
import subprocess

import pytest

from motor_mesh.cli import keys
from motor_mesh.common.apikeys import KeyRing
from tests.procs import ROOT, motor_argv

KEY = "sk-motor-Fh3kL9qW2xZ7mN4bV8cR1tY6uJ0pA5sD"


def run(*args: str, stdin: str | bytes) -> tuple[subprocess.CompletedProcess[bytes], list[str]]:
    argv = motor_argv(*args)
    data = stdin.encode() if isinstance(stdin, str) else stdin
    done = subprocess.run(argv, input=data, cwd=ROOT, capture_output=True, timeout=60, check=False)
    return done, argv


def test_hash_prints_a_sha256_form_of_the_key_on_stdin() -> None:
    done, argv = run("keys", "hash", stdin=KEY + "\n")
    assert done.returncode == 0, done.stderr
    stored = done.stdout.decode()
    assert stored.endswith("\n") and stored.count("\n") == 1
    stored = stored.strip()
    assert stored.startswith("sha256:")
    assert KeyRing([(stored, "me")]).find(KEY.encode()) == "me"
    assert KEY not in stored and KEY.encode() not in done.stderr
    assert not any(KEY in a for a in argv)


async def test_hash_pbkdf2_prints_a_form_that_resolves_to_the_key() -> None:
    done, argv = run("keys", "hash", "--scheme", "pbkdf2", "--iterations", "100000", stdin=KEY)
    assert done.returncode == 0, done.stderr
    stored = done.stdout.decode().strip()
    assert stored.startswith("pbkdf2_sha256$100000$")
    ring = KeyRing([(stored, "me")])
    assert await ring.resolve(KEY.encode()) == "me"
    assert await ring.resolve(KEY.encode()[:-1]) is None
    assert KEY.encode() not in done.stderr and not any(KEY in a for a in argv)


@pytest.mark.parametrize("stdin", ["", "\n", "\r\n"])
def test_an_empty_key_is_one_line_and_exit_1(stdin: str) -> None:
    done, _ = run("keys", "hash", stdin=stdin)
    assert done.returncode == 1
    assert done.stdout == b""
    assert done.stderr.decode().splitlines() == ["motor keys hash: no key on stdin"]


def test_new_prints_a_random_key_and_its_sha256_form() -> None:
    done, _ = run("keys", "new", "--hash", stdin="")
    assert done.returncode == 0, done.stderr
    key, stored = done.stdout.decode().splitlines()
    assert key.startswith("sk-motor-") and len(key) == len("sk-motor-") + 43
    assert KeyRing([(stored, "me")]).find(key.encode()) == "me"
    again, _ = run("keys", "new", stdin="")
    assert again.stdout.decode().splitlines()[0] != key


# In process from here: the same main() behind the command, without starting Python each time.


def hash_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: bytes, *args: str
) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    code = keys.main(["hash", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("stdin", "problem"),
    [
        (f"{KEY}\nsecond line\n".encode(), "stdin must hold one key on one line"),
        (f" {KEY}\n".encode(), "the key starts or ends with whitespace"),
        (f"{KEY}\x00\n".encode(), "the key holds control characters"),
        (KEY.encode() + b"\xff\n", "stdin is not UTF-8"),
        (b"k" * (64 * 1024 + 1), "stdin holds more than 65536 bytes"),
    ],
)
def test_unusable_input_is_one_line_without_the_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: bytes, problem: str
) -> None:
    code, out, err = hash_in_process(monkeypatch, capsys, stdin)
    assert (code, out) == (1, "")
    assert err.splitlines() == [f"motor keys hash: {problem}"]
    assert KEY not in err


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--iterations", "200000"], "--iterations applies to --scheme pbkdf2 only"),
        (["--scheme", "pbkdf2", "--iterations", "99999"], "--iterations must be from 100000 to 10000000"),
    ],
)
def test_bad_iterations_are_a_usage_error_before_the_key_is_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], problem: str
) -> None:
    stdin = io.BytesIO(KEY.encode())
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(stdin))
    code = keys.main(["hash", *args])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.splitlines() == [f"motor keys hash: {problem}"]
    assert stdin.tell() == 0  # refused before the key was read


def test_a_line_end_is_not_part_of_the_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for line_end in (b"", b"\n", b"\r\n"):
        code, out, _ = hash_in_process(monkeypatch, capsys, KEY.encode() + line_end)
        assert code == 0
        assert KeyRing([(out.strip(), 1)]).find(KEY.encode()) == 1
