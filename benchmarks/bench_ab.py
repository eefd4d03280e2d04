"""A block's cost before and after a change, both measured in one process.

Run:  python benchmarks/bench_ab.py [--base REV] [--repeats N] [--number N]

Two runs of ``bench_blocks.py`` on a shared machine differ by more than most
changes do (seen here: 1.6x on every row, the floor row included, between two
runs of the same code).  This script extracts ``REV``'s package (default
``HEAD``) with ``git archive`` under another name, imports it beside the
working tree's, and times the same blocks of each in alternating repeats, so
machine noise hits both sides alike.  It prints medians (µs per block) and
the ratio new / base.  With ``DETERMINISTIC_CTX_NO_FAST_PATHS=1`` the working
tree runs with its fast paths off (the base revision may not read it).  By
default the thread's CPU time is measured: on a shared machine wall time
swings by 1.5x between runs of the same code, CPU time much less.  The
package uses relative imports only, so a renamed copy is a complete second
engine (both register fork hooks; nothing here forks).
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def extract(rev: str, into: Path) -> str:
    """``rev``'s ``deterministic_ctx`` as the package ``dctx_base`` under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "deterministic_ctx"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "deterministic_ctx").rename(into / "dctx_base")
    return "dctx_base"


def rows(mod: Any) -> dict[str, Callable[[], None]]:
    det = mod.deterministic(seed=0)
    iso = mod.isolated()

    def fresh() -> None:
        with mod.deterministic(seed=0):
            pass

    def reused() -> None:
        with det:
            pass

    seeds = iter(range(10**6, 2**32))

    def new_seed() -> None:  # PYTHONHASHSEED takes a new value every time (issue 44)
        with mod.deterministic(seed=next(seeds)):
            pass

    def nested() -> None:
        with det, det:
            pass

    def isolated() -> None:
        with iso:
            pass

    def gen() -> Any:
        yield
        yield

    stepped = mod.reproducible(seed=0)(gen)

    def generator() -> None:
        for _ in stepped():
            pass

    def snapshot() -> None:
        mod.Snapshot.capture().restore()

    return {
        "fresh block": fresh,
        "reused block": reused,
        "new seed each block": new_seed,
        "nested pair": nested,
        "isolated block": isolated,
        "@reproducible call": mod.reproducible(seed=0)(lambda: None),
        "generator (3 steps)": generator,
        "Snapshot capture+restore": snapshot,
    }


def with_rngs(mod: Any, count: int) -> tuple[list[Any], Callable[[], None]]:
    """``count`` registered ``random.Random`` and a block that seeds and restores them."""
    rngs = [mod.register_rng(random.Random(i), key=f"bench{i}") for i in range(count)]
    det = mod.deterministic(seed=0)

    def block() -> None:
        with det:
            pass

    return rngs, block


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD", help="the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--number", type=int, default=500)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: the thread's CPU time (time.thread_time), which a loaded machine's "
        "scheduler does not inflate; wall: time.perf_counter",
    )
    args = parser.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    def timed(fn: Callable[[], None]) -> float:
        return timeit.Timer(fn, timer=clock).timeit(number=args.number) / args.number

    with tempfile.TemporaryDirectory() as tmp:
        base_name = extract(args.base, Path(tmp))
        sys.path[:0] = [tmp, str(ROOT)]
        sides = {"base": importlib.import_module(base_name)}
        sides["new"] = importlib.import_module("deterministic_ctx")
        table = {side: rows(mod) for side, mod in sides.items()}
        times: dict[str, dict[str, list[float]]] = {s: {r: [] for r in table[s]} for s in table}
        for i in range(args.repeats):
            for side in ("base", "new") if i % 2 else ("new", "base"):
                for row, fn in table[side].items():
                    times[side][row].append(timed(fn))
        # Last, so that the rows above run with no registered RNG: each side's
        # own registry holds 64 of them (a block of one side never sees the other's).
        row = "block, 64 random.Random"
        held = {}
        for side, mod in sides.items():
            held[side], table[side][row] = with_rngs(mod, 64)
            times[side][row] = []
        for i in range(args.repeats):
            for side in ("base", "new") if i % 2 else ("new", "base"):
                fn = table[side][row]
                times[side][row].append(timed(fn))
    fast = "off" if os.environ.get("DETERMINISTIC_CTX_NO_FAST_PATHS") == "1" else "on"
    print(
        f"base {args.base} against the working tree (its fast paths {fast}); "
        f"median of {args.repeats} repeats, {args.clock} time"
    )
    for row in table["base"]:
        b = statistics.median(times["base"][row]) * 1e6
        n = statistics.median(times["new"][row]) * 1e6
        print(f"  {row:22s} base {b:8.2f} µs   new {n:8.2f} µs   new/base {n / b:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
