"""``motor keys hash`` and ``motor keys new``: client API keys for a tenants file.

``hash`` reads the key on stdin, never from the command line, where ``ps`` and the shell's
history would show it to others; on a terminal it asks for it without echo. It prints the
stored form (motor_mesh.common.apikeys) for the file, so the file does not hold the key itself.
"""

from __future__ import annotations

import argparse
import getpass
import secrets
import sys

from motor_mesh.common.apikeys import DEFAULT_ITERATIONS, MAX_ITERATIONS, MIN_HASH_ITERATIONS, hash_key

PROG = "motor keys"
PREFIX = "sk-motor-"
# The inference port refuses requests whose headers are larger: a longer key could never be used.
_MAX_INPUT = 64 * 1024


class _InputError(Exception):
    """What is wrong with stdin, in one line without the key."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Client API keys for a tenants file.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    hashing = commands.add_parser(
        "hash",
        help="print the stored form of the key given on stdin",
        description="Read one key on stdin (never on the command line, where ps shows it) and print "
        "its stored form for a tenants file's keys. sha256 suits random keys such as those of "
        "'motor keys new'; pbkdf2 is for keys people choose, and costs the Coordinator a PBKDF2 "
        "round for each new key it sees.",
    )
    hashing.add_argument("--scheme", choices=("sha256", "pbkdf2"), default="sha256")
    hashing.add_argument(
        "--iterations",
        type=int,
        metavar="N",
        help=f"pbkdf2 only: {MIN_HASH_ITERATIONS}..{MAX_ITERATIONS} (default {DEFAULT_ITERATIONS})",
    )
    new = commands.add_parser(
        "new",
        help="print a new random key",
        description=f"Print a new random key ('{PREFIX}' and 256 random bits).",
    )
    new.add_argument("--hash", action="store_true", help="print its sha256 form on a second line")
    return parser


def _read_key() -> str:
    """The key on stdin without its line end; on a terminal, asked for without echo."""
    if sys.stdin.isatty():
        return getpass.getpass("API key: ")
    data = sys.stdin.buffer.read(_MAX_INPUT + 1)
    if len(data) > _MAX_INPUT:
        raise _InputError(f"stdin holds more than {_MAX_INPUT} bytes")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise _InputError("stdin is not UTF-8") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if "\n" in text:
        raise _InputError("stdin must hold one key on one line")
    if not text:
        raise _InputError("no key on stdin")
    return text


def _hash(args: argparse.Namespace) -> int:
    try:
        key = _read_key()
        iterations = DEFAULT_ITERATIONS if args.iterations is None else args.iterations
        stored = hash_key(key, args.scheme, iterations)
    except (_InputError, ValueError) as err:  # ValueError from hash_key never holds the key
        print(f"{PROG} hash: {err}", file=sys.stderr)
        return 1
    print(stored)
    return 0


def _new(args: argparse.Namespace) -> int:
    key = PREFIX + secrets.token_urlsafe(32)
    print(key)
    if args.hash:
        print(hash_key(key))
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse: --help exits 0, a usage error 2
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "new":
        return _new(args)
    if args.iterations is not None:  # checked before the key is asked for
        if args.scheme != "pbkdf2":
            print(f"{PROG} hash: --iterations applies to --scheme pbkdf2 only", file=sys.stderr)
            return 2
        if not MIN_HASH_ITERATIONS <= args.iterations <= MAX_ITERATIONS:
            print(
                f"{PROG} hash: --iterations must be from {MIN_HASH_ITERATIONS} to {MAX_ITERATIONS}",
                file=sys.stderr,
            )
            return 2
    return _hash(args)


if __name__ == "__main__":
    sys.exit(main())
