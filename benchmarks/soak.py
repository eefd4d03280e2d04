"""Soak: a million blocks, with memory and torch's lazy CUDA queue before and after.

Run:  python benchmarks/soak.py [--blocks N]

RSS is read from /proc (Linux); Python-side allocations from
``sys.getallocatedblocks()``.  A leak of one object per block would show as
a million extra allocated blocks.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time

import torch

from deterministic_ctx import deterministic


def rss_kib() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args(argv)

    block = deterministic(seed=0)
    for _ in range(1000):
        with block:
            torch.rand(1)
    gc.collect()
    rss0, objs0, queue0 = rss_kib(), sys.getallocatedblocks(), len(torch.cuda._queued_calls)
    start = time.perf_counter()
    for i in range(args.blocks):
        with block:
            torch.rand(1)
            if i % 1000 == 0:
                torch.manual_seed(i)  # queues lazy seeds, which must not pile up
    elapsed = time.perf_counter() - start
    gc.collect()
    rss1, objs1, queue1 = rss_kib(), sys.getallocatedblocks(), len(torch.cuda._queued_calls)
    print(f"{args.blocks} blocks in {elapsed:.1f} s ({elapsed / args.blocks * 1e6:.1f} µs each)")
    print(f"RSS: {rss0} KiB -> {rss1} KiB ({rss1 - rss0:+d} KiB)")
    print(f"Python allocated blocks: {objs0} -> {objs1} ({objs1 - objs0:+d})")
    print(f"torch.cuda lazy queue: {queue0} -> {queue1}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
