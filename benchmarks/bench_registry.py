"""Cost of the user-RNG registry before and after many register/collect cycles.

Run:  python benchmarks/bench_registry.py [--cycles N] [--repeats N] [--number N]

``register_rng(random.Random())`` with nothing else holding the object is one
register/collect cycle: the weak reference's callback removes the entry at
once.  This measures, in one run, ``register_rng`` + ``unregister_rng`` of a
live object, ``unregister_rng`` alone and a block with one registered RNG
(interleaved, medians) before any cycle (the baseline row) and again after
every quarter of the cycles, with the cycles' own cost, the registry's size
and RSS.  Every ratio to the baseline should be about 1: nothing grows.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from bench_blocks import measure  # the same interleaved medians as every block benchmark

from deterministic_ctx import deterministic, register_rng, unregister_rng
from deterministic_ctx.sources.user_rngs import registry as _registry

_kept = random.Random(1)
_steady = random.Random(2)
_block = deterministic(seed=0)


def register_and_unregister() -> None:
    register_rng(_kept, key="bench-kept")
    unregister_rng(_kept)


def block() -> None:
    with _block:
        pass


def cycle() -> None:
    register_rng(random.Random(0))  # collected before this returns


def rss_kib() -> int:
    """Resident set size now (Linux), else the peak ``ru_maxrss``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def unregister_cost(repeats: int, number: int) -> float:
    """Median µs of ``unregister_rng`` alone (the registrations are not timed)."""
    values = []
    objs = [random.Random(i) for i in range(number)]
    for _ in range(repeats):
        for obj in objs:
            register_rng(obj)
        start = time.perf_counter()
        for obj in objs:
            unregister_rng(obj)
        values.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(values)


def run_cycles(count: int) -> float:
    """Run ``count`` register/collect cycles; µs per cycle."""
    start = time.perf_counter()
    for _ in range(count):
        cycle()
    return (time.perf_counter() - start) / max(count, 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=4, help="measurements between cycles")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--number", type=int, default=1000)
    args = parser.parse_args(argv)

    register_rng(_steady, key="bench-steady")  # a block iterates over one live RNG
    cases: dict[str, Callable[[], None]] = {
        "register_rng + unregister_rng": register_and_unregister,
        "block with 1 registered RNG": block,
    }
    print(f"torch {torch.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}")
    print(
        f"medians of {args.repeats} repeats x {args.number} calls, µs per call, measured "
        f"after every {args.cycles // args.steps} register/collect cycles\n"
    )
    rows: list[tuple[int, dict[str, float], float, int, int]] = []
    done, per_cycle = 0, 0.0
    for step in range(args.steps + 1):
        if step:
            chunk = args.cycles // args.steps
            per_cycle = run_cycles(chunk)
            done += chunk
        gc.collect()
        costs = measure(cases, args.repeats, args.number)
        costs["unregister_rng"] = unregister_cost(args.repeats, args.number)
        gc.collect()
        rows.append((done, costs, per_cycle, len(_registry._entries), rss_kib()))

    names = list(rows[0][1])
    header = "  ".join(f"{n:>30}" for n in names)
    print(f"  {'cycles':>7}  {header}  {'µs/cycle':>8}  {'entries':>7}  {'RSS KiB':>9}")
    for done, costs, per_cycle, entries, rss in rows:
        values = "  ".join(f"{costs[n]:30.2f}" for n in names)
        cyc = f"{per_cycle:8.2f}" if done else f"{'':>8}"
        print(f"  {done:>7}  {values}  {cyc}  {entries:>7}  {rss:>9}")

    first, last = rows[0], rows[-1]
    print(f"\nratios after {last[0]} cycles / before (baseline: the first row):")
    for name in names:
        print(f"  {name:<32}{last[1][name] / first[1][name]:6.3f}")
    if len(rows) > 2:
        print(f"  {'µs per cycle, last / first chunk':<32}{last[2] / rows[1][2]:6.3f}")
    print(f"  registry entries {first[3]} -> {last[3]}, RSS {last[4] - first[4]:+d} KiB")
    unregister_rng(_steady)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
