"""``motor register``: standalone mode (operator-managed Coordinator table).

Not built yet; it lands with standalone mode. The command exists so operators get a clear answer
rather than a traceback.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: motor register set|add|del|list ...  (standalone mode: not implemented yet)")
        return 0
    print("motor register: standalone mode is not implemented yet", file=sys.stderr)
    return 1
