"""`python -m bench [NAME ...]`: run every bench/bench_*.py module's main(), or only the named ones."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    known = sorted(p.stem.removeprefix("bench_") for p in Path(__file__).parent.glob("bench_*.py"))
    wanted = [a.removeprefix("bench_").removesuffix(".py") for a in argv] or known
    unknown = [w for w in wanted if w not in known]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    rc = 0
    for name in wanted:
        rc = max(rc, int(importlib.import_module(f"bench.bench_{name}").main() or 0))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
