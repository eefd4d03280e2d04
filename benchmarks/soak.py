"""Soak: a million blocks, then resident memory over distinct seeds (issue 44).

Run:  python benchmarks/soak.py [--blocks N] [--seeds N] [--seed-everything N]

1. ``--blocks`` blocks with one seed: time, RSS, Python allocations and
   torch's lazy CUDA queue before and after.  A leak of one object per block
   would show as a million extra allocated blocks.
2. ``--seeds`` blocks ``with deterministic(seed=k): pass`` and
   ``--seed-everything`` calls ``seed_everything(k)``, each ``k`` new, after a
   warm-up of 2,000 distinct seeds (the bounded seeding caches fill then):
   the resident memory still held afterwards, read after ``gc.collect()`` and
   ``malloc_trim(0)`` (glibc), so that only memory still in use counts.  The
   target: at most 1 MiB of growth over 150,000 blocks and 75,000 calls.
   Every call of ``os.putenv`` with a new value keeps ~64 bytes in glibc for
   good (``os.environ["PYTHONHASHSEED"] = str(k)`` is shown as the reference).

RSS is read from /proc (Linux); Python-side allocations from
``sys.getallocatedblocks()``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import sys
import time
from collections.abc import Callable

import torch

from deterministic_ctx import Snapshot, deterministic, seed_everything
from deterministic_ctx.sources import fast_paths

_libc = ctypes.CDLL(None) if os.name == "posix" else None
_TRIM = getattr(_libc, "malloc_trim", None)


def rss_kib() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def held_kib() -> int:
    """Resident memory once freed memory has gone back to the system."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)
    return rss_kib()


def soak(blocks: int) -> None:
    block = deterministic(seed=0)
    for _ in range(1000):
        with block:
            torch.rand(1)
    gc.collect()
    rss0, objs0, queue0 = rss_kib(), sys.getallocatedblocks(), len(torch.cuda._queued_calls)
    start = time.perf_counter()
    for i in range(blocks):
        with block:
            torch.rand(1)
            if i % 1000 == 0:
                torch.manual_seed(i)  # queues lazy seeds, which must not pile up
    elapsed = time.perf_counter() - start
    gc.collect()
    rss1, objs1, queue1 = rss_kib(), sys.getallocatedblocks(), len(torch.cuda._queued_calls)
    print(f"{blocks} blocks in {elapsed:.1f} s ({elapsed / blocks * 1e6:.1f} µs each)")
    print(f"RSS: {rss0} KiB -> {rss1} KiB ({rss1 - rss0:+d} KiB)")
    print(f"Python allocated blocks: {objs0} -> {objs1} ({objs1 - objs0:+d})")
    print(f"torch.cuda lazy queue: {queue0} -> {queue1}")


def _blocks(seeds: range) -> None:
    for k in seeds:
        with deterministic(seed=k):
            pass


def _seed_everything(seeds: range) -> None:
    for k in seeds:
        seed_everything(k)


def _putenv(seeds: range) -> None:
    for k in seeds:
        os.environ["PYTHONHASHSEED"] = str(k)


def distinct(name: str, loop: Callable[[range], None], count: int, first: int) -> None:
    """``loop`` over ``count`` seeds never used before, after a warm-up."""
    before = Snapshot.capture()
    try:
        loop(range(first, first + 2000))
        rss0, objs0 = held_kib(), sys.getallocatedblocks()
        start = time.perf_counter()
        loop(range(first + 10_000, first + 10_000 + count))
        elapsed = time.perf_counter() - start
        rss1, objs1 = held_kib(), sys.getallocatedblocks()
    finally:
        before.restore()
    growth = rss1 - rss0
    print(
        f"{count:>7} {name:<44} {rss0} -> {rss1} KiB ({growth:+d} KiB, "
        f"{growth * 1024 / count:.1f} B each; Python blocks {objs1 - objs0:+d}) "
        f"in {elapsed:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000, help="0 to skip the soak")
    parser.add_argument("--seeds", type=int, default=150_000, help="blocks, distinct seeds")
    parser.add_argument(
        "--seed-everything", type=int, default=75_000, help="seed_everything, distinct seeds"
    )
    args = parser.parse_args(argv)
    if args.blocks:
        soak(args.blocks)
    owned = fast_paths().get("os.environ: seeds written into entries the process owns (C putenv)")
    print(f"resident memory over distinct seeds (owned environment entries: {owned}):")
    if args.seeds:
        distinct("blocks `with deterministic(seed=k): pass`", _blocks, args.seeds, 10**6)
    if args.seed_everything:
        distinct("`seed_everything(k)`", _seed_everything, args.seed_everything, 2 * 10**6)
    if args.seeds:
        distinct("`os.environ['PYTHONHASHSEED'] = str(k)` alone", _putenv, args.seeds, 3 * 10**6)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
