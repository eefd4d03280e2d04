"""Cost of entering and leaving a block, against baselines measured in the same run.

Run:  python benchmarks/bench_blocks.py [--repeats N] [--number N]

Prints medians (µs per operation) over interleaved repeats, so machine noise
hits every row alike, then the ratios the performance targets are stated in.
Lightning rows appear when ``lightning`` is installed (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import timeit
import tracemalloc
from collections.abc import Callable

import numpy as np
import torch

from deterministic_ctx import Snapshot, deterministic, register_rng, reproducible, unregister_rng


def naive_recipe() -> None:
    """The hand-written isolate-and-seed most code bases have."""
    r, n, t = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    random.setstate(r)
    np.random.set_state(n)
    torch.set_rng_state(t)


def fork_rng() -> None:
    with torch.random.fork_rng(devices=[]):
        pass


def ours_block() -> None:
    with deterministic(seed=0):
        pass


_reused = deterministic(seed=0)


def ours_reused() -> None:
    with _reused:
        pass


def ours_snapshot() -> None:
    Snapshot.capture().restore()


@reproducible
def ours_decorated() -> None:
    pass


@reproducible
def _gen():
    while True:
        yield


_g = _gen()


def ours_generator_step() -> None:
    next(_g)


def nested(depth: int) -> Callable[[], None]:
    def run() -> None:
        with contextlib.ExitStack() as stack:
            for _ in range(depth - 1):
                stack.enter_context(deterministic(seed=0))
            bench_nested(stack)

    return run


def bench_nested(stack: contextlib.ExitStack) -> None:
    pass


def lightning_cases() -> dict[str, Callable[[], None]]:
    try:
        from lightning.fabric.utilities.seed import seed_everything
        from lightning.pytorch.utilities.seed import isolate_rng
    except ImportError:
        return {}

    def isolate() -> None:
        with isolate_rng():
            pass

    def isolate_and_seed() -> None:
        with isolate_rng():
            seed_everything(0, verbose=False)

    return {
        "lightning isolate_rng": isolate,
        "lightning isolate_rng+seed_everything": isolate_and_seed,
    }


def measure(cases: dict[str, Callable[[], None]], repeats: int, number: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm up: imports, caches, layout probes
        for _ in range(200):
            fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            samples[name].append(timeit.timeit(fn, number=number) / number * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def depth_cost(depth: int, repeats: int, number: int) -> float:
    """Median µs of one innermost block entered at ``depth`` (1 = not nested)."""
    values = []
    with contextlib.ExitStack() as stack:
        for _ in range(depth - 1):
            stack.enter_context(deterministic(seed=0))
        for _ in range(repeats):
            values.append(timeit.timeit(ours_reused, number=number) / number * 1e6)
    return statistics.median(values)


def user_rng_cost(count: int, repeats: int, number: int) -> float:
    rngs = [register_rng(random.Random(i), key=f"bench-{i}") for i in range(count)]
    try:
        return measure({"x": ours_reused}, repeats, number)["x"]
    finally:
        for rng in rngs:
            unregister_rng(rng)


def snapshot_bytes() -> int:
    tracemalloc.start()
    snaps = [Snapshot.capture() for _ in range(100)]
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del snaps
    return size // 100


def _ratio(label: str, ratio: float, target: float | None) -> None:
    line = f"  {label:<36}{ratio:6.3f}"
    if target is not None:
        line += f"  (target <= {target:.3f}) {'ok' if ratio <= target else 'MISSED'}"
    print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args(argv)

    cases: dict[str, Callable[[], None]] = {
        "deterministic(seed=0) block": ours_block,
        "reused deterministic object": ours_reused,
        "Snapshot.capture()+restore()": ours_snapshot,
        "@reproducible no-op call": ours_decorated,
        "@reproducible generator step": ours_generator_step,
        "naive recipe (get/seed/set)": naive_recipe,
        "torch.random.fork_rng(devices=[])": fork_rng,
        **lightning_cases(),
    }
    medians = measure(cases, args.repeats, args.number)
    print(f"torch {torch.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}")
    print(f"median of {args.repeats} repeats x {args.number} calls, µs per call\n")
    width = max(map(len, medians))
    for name, value in medians.items():
        print(f"  {name:<{width}}  {value:8.2f}")

    block = medians["deterministic(seed=0) block"]
    print("\nratios (targets from issue 4):")
    lit_full = medians.get("lightning isolate_rng+seed_everything")
    lit_iso = medians.get("lightning isolate_rng")
    if lit_full is not None and lit_iso is not None:
        r1 = block / lit_full
        r2 = medians["Snapshot.capture()+restore()"] / lit_iso
        _ratio("block / lightning isolate+seed", r1, 0.1)
        _ratio("snapshot / lightning isolate_rng", r2, 0.25)
    else:
        print("  lightning not installed: pip install -e .[bench] for the Lightning baselines")
    r3 = medians["@reproducible no-op call"] / block
    _ratio("decorated call / block", r3, 1.1)
    naive = block / medians["naive recipe (get/seed/set)"]
    _ratio("block / naive recipe", naive, None)

    small = max(3, args.repeats // 3)
    print("\nscaling (reused block, µs):")
    depths = [f"{d:>2}: {depth_cost(d, small, args.number):6.2f}" for d in (1, 4, 16)]
    rngs = [f"{n:>2}: {user_rng_cost(n, small, args.number // 4):6.2f}" for n in (0, 4, 16)]
    print("  nesting depth   " + "  ".join(depths))
    print("  user RNGs       " + "  ".join(rngs))
    print(f"\nmemory per snapshot: {snapshot_bytes()} bytes (tracemalloc, Python-side)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
