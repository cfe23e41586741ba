"""``kvtransform bench SUITE [key=value ...] [-m]``: forwarded to :func:`kvtransform.bench.run` (one long CSV,
markdown table and plot per suite; every row prints the command that reproduces it)."""
from __future__ import annotations

from typing import Sequence

from .errors import fail, guard

__all__ = ["main"]

HELP = """usage: kvtransform bench SUITE [key=value ...] [-m]

Run a benchmark suite (kvtransform.bench.run): long-format CSV, markdown table and plot; every row prints the
command that reproduces it. `kvtransform bench SUITE --help` shows the suite's options."""


def main(args: Sequence[str]) -> int:
    """``kvtransform bench SUITE ...``; returns the suite's exit status (0 when it returns rows)."""
    if not args or args[0] in ("-h", "--help"):
        try:
            from ..bench import SUITES

            suites = f"\n\nsuites: {', '.join(SUITES)}"
        except ImportError:
            suites = ""
        print(HELP + suites)
        return 0
    try:
        from ..bench import run
    except ImportError:
        fail("kvtransform bench is not available in this version (kvtransform.bench.run is missing)")
    rc = guard(run, args[0], list(args[1:]))
    return int(rc) if isinstance(rc, int) else 0
