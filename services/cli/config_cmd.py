"""``motor config check FILE [--section S]``: validate a configuration file.

Only the file is checked: ``MOTOR_*`` environment variables are deliberately not applied, so the
verdict is about the file and does not depend on the shell it runs in. Key file permissions are
checked by each service when it starts, not here (the files may live on another machine).
"""

from __future__ import annotations

import argparse
import sys

from motor_mesh.common.config import SECTIONS, ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="motor config", description="Configuration tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    check = commands.add_parser(
        "check",
        help="validate a configuration file",
        description="Validate a configuration file: print OK, or each error on one line (exit 1).",
    )
    check.add_argument("file", metavar="FILE", help="the JSON configuration file")
    check.add_argument("--section", choices=SECTIONS, help="the section a flat (unsectioned) file holds")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse: --help exits 0, a usage error 2
        return exc.code if isinstance(exc.code, int) else 2
    try:
        load_config(args.file, section=args.section, env={})
    except ConfigError as exc:
        for line in exc.errors:
            print(line, file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
