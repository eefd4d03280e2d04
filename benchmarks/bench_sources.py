"""Each source's capture, apply and restore alone: where a block's time goes.

Run:  python benchmarks/bench_sources.py [--repeats N] [--number N]

A block is the engine's bookkeeping around one capture, one apply and one
restore of every source of ``SOURCES`` (``core/world.py`` runs them in a
loop).  This times each source's three methods alone, as the thread's CPU
time (a shared machine's scheduler does not inflate it), medians in µs per
call, the cost of an empty call subtracted: ``restore`` puts back the state
just captured (what a block's exit does when its body changed nothing),
``apply`` is measured with the restore that undoes it, minus that restore.
With ``DETERMINISTIC_CTX_NO_FAST_PATHS=1`` the sources run without their
fast paths.  Compare sources and revisions in one run, not µs across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deterministic_ctx
from deterministic_ctx import sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--number", type=int, default=3000)
    args = parser.parse_args(argv)

    def timed(fn: Callable[[], object]) -> float:
        runs = []
        for _ in range(args.repeats):
            start = time.thread_time_ns()
            for _ in range(args.number):
                fn()
            runs.append((time.thread_time_ns() - start) / args.number / 1000)
        return statistics.median(runs)

    settings = deterministic_ctx.deterministic(seed=0)._settings.resolved()
    empty = timed(lambda: None)
    fast = "off" if os.environ.get("DETERMINISTIC_CTX_NO_FAST_PATHS") == "1" else "on"
    print(f"µs per call, median of {args.repeats} x {args.number}, fast paths {fast}")
    totals = [0.0, 0.0, 0.0]
    for source in sources.SOURCES:
        state = source.capture()
        capture = timed(source.capture) - empty
        restore = timed(lambda s=source, st=state: s.restore(st)) - empty
        both = timed(lambda s=source, st=state: (s.apply(settings), s.restore(st))) - empty
        row = (capture, both - restore, restore)
        totals = [t + r for t, r in zip(totals, row, strict=True)]
        print(
            f"  {source.name:15s} capture {row[0]:6.2f}  apply {row[1]:6.2f}  restore {row[2]:6.2f}"
        )
    capture, apply, restore = totals
    print(f"  {'all':15s} capture {capture:6.2f}  apply {apply:6.2f}  restore {restore:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
