"""Cost of entering and leaving a block, against baselines measured in the same run.

Run:  python benchmarks/bench_blocks.py [--repeats N] [--number N] [--cuda]

Prints medians (µs per operation) over interleaved repeats, so machine noise
hits every row alike, then the ratios the performance targets of issue 15 are
stated in.  Lightning rows appear when ``lightning`` is installed
(``pip install -e .[bench]``).  With ``torch._inductor`` imported (Lightning
and ``torch.compile`` import it) a block also captures and restores
inductor's deterministic flag; the "(inductor not imported)" row measures the
block of a program without it (see :func:`without_inductor`).

The "floor" row is the work a block cannot avoid, written out by hand as one
straight-line function of C calls (no error handling, no nesting, nothing
generic): read both Mersenne Twisters, torch's state, the nine
``fp32_precision`` entries and the legacy matmul/cuDNN fields, six boolean
flags, the managed environment variables and torch's defaults; seed; set the
flags and two environment variables; write everything back and read the
precision again.  It tells how much of a block is structure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import random
import statistics
import sys
import timeit
import tracemalloc
from collections.abc import Callable, Iterator

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


_next_seed = iter(range(1, 2**32))


def ours_new_seed() -> None:
    """The per-sample pattern: ``with deterministic(seed=idx):`` with a new idx each time."""
    with deterministic(seed=next(_next_seed)):
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

    seeds = iter(range(1, 2**32))

    def isolate_and_new_seed() -> None:
        with isolate_rng():
            seed_everything(next(seeds), verbose=False)

    return {
        "lightning isolate_rng": isolate,
        "lightning isolate_rng+seed_everything": isolate_and_seed,
        "lightning isolate_rng+seed_everything(new)": isolate_and_new_seed,
    }


def floor_case() -> Callable[[], None]:
    """The unavoidable C calls of one block, inlined by hand (see the module docstring)."""
    import os
    import threading

    from deterministic_ctx import managed_env_vars
    from deterministic_ctx.sources.rngs.layouts import NUMPY_LAYOUT, RANDOM_LAYOUT, mt19937_view

    if RANDOM_LAYOUT is None or NUMPY_LAYOUT is None:
        return lambda: None
    c = torch._C
    rng = random._inst  # type: ignore[attr-defined]
    rview = RANDOM_LAYOUT.view(rng)
    rs = np.random.mtrand._rand
    bg = rs._bit_generator
    mt, gauss = mt19937_view(bg), NUMPY_LAYOUT.view(rs)
    gen = torch.default_generator
    seeded = (rview.tobytes(), mt.tobytes(), gen.get_state())
    get = c._get_fp32_precision_getter
    backends = ("generic", *["cuda"] * 4, *["mkldnn"] * 4)
    ops = ("all", "all", "matmul", "conv", "rnn", "all", "matmul", "conv", "rnn")
    bools = (
        c._get_cudnn_deterministic,
        c._get_cudnn_benchmark,
        c._get_deterministic_algorithms,
        c._get_deterministic_algorithms_warn_only,
        c._get_deterministic_fill_uninitialized_memory,
        c._get_mkldnn_deterministic,
    )
    env = os.environ
    data = env._data  # type: ignore[attr-defined]
    keys = tuple(map(env.encodekey, managed_env_vars()))  # type: ignore[attr-defined]
    cublas, hashseed = keys[0], keys[1]
    lock = threading.RLock()
    no_gauss = bytes(16)

    def floor() -> None:
        lock.acquire()
        r, g = rview.tobytes(), rng.gauss_next
        with bg.lock:
            n = (mt.tobytes(), gauss.tobytes())
        t = gen.get_state()
        tuple(map(get, backends, ops))
        c._get_float32_matmul_precision()
        c._get_cudnn_allow_tf32()
        b = [f() for f in bools]
        tuple(map(data.get, keys))
        torch.get_default_dtype(), torch.get_num_threads()
        rview[:] = seeded[0]
        rng.gauss_next = None
        with bg.lock:
            mt[:], gauss[:] = seeded[1], no_gauss
        gen.set_state(seeded[2])
        c._set_cudnn_deterministic(True)
        c._set_deterministic_algorithms(True, warn_only=False)
        c._set_mkldnn_deterministic(True)
        os.putenv(cublas, b":4096:8")
        data[cublas] = b":4096:8"
        os.putenv(hashseed, b"0")
        data[hashseed] = b"0"
        c._set_cudnn_deterministic(b[0])
        c._set_cudnn_benchmark(b[1])
        c._set_deterministic_algorithms(b[2], warn_only=b[3])
        c._set_deterministic_fill_uninitialized_memory(b[4])
        c._set_mkldnn_deterministic(b[5])
        tuple(map(get, backends, ops))
        c._get_float32_matmul_precision()
        c._get_cudnn_allow_tf32()
        tuple(map(data.get, keys))
        os.unsetenv(cublas)
        data.pop(cublas)
        os.unsetenv(hashseed)
        data.pop(hashseed)
        torch.get_default_dtype(), torch.get_num_threads()
        gen.set_state(t)
        with bg.lock:
            mt[:], gauss[:] = n
        rview[:] = r
        rng.gauss_next = g
        lock.release()

    return floor


#: Rows whose name ends with this run with ``torch._inductor.config`` out of
#: ``sys.modules`` (see :func:`without_inductor`).
NO_INDUCTOR = " (inductor not imported)"
_CONFIG = "torch._inductor.config"


@contextlib.contextmanager
def without_inductor() -> Iterator[None]:
    """Run as if inductor had never been imported, for the rows that say so.

    Lightning imports ``torch._inductor``, so its baselines cannot run in a
    process without it; a block only looks for ``torch._inductor.config`` in
    ``sys.modules`` (it never imports it), so taking that entry out for the
    duration of a row measures the block of a program that never loaded
    inductor, interleaved with the Lightning rows.
    """
    saved = sys.modules.pop(_CONFIG, None)
    try:
        yield
    finally:
        if saved is not None:
            sys.modules[_CONFIG] = saved


def _timed(name: str, fn: Callable[[], None], number: int) -> float:
    if name.endswith(NO_INDUCTOR):
        with without_inductor():
            return timeit.timeit(fn, number=number)
    return timeit.timeit(fn, number=number)


def measure(cases: dict[str, Callable[[], None]], repeats: int, number: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for name, fn in cases.items():  # warm up: imports, caches, layout probes
        _timed(name, fn, 200)
    for _ in range(repeats):
        for name, fn in cases.items():
            samples[name].append(_timed(name, fn, number) / number * 1e6)
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


def auto_rank_costs(repeats: int, number: int) -> dict[str, float] | None:
    """A reused block with ``rank="auto"`` and one with no rank, in a gloo process
    group of one (``rank="auto"`` asks the group at every block), or ``None``
    without torch.distributed."""
    dist = torch.distributed
    if not dist.is_available() or dist.is_initialized():
        return None
    auto = deterministic(seed=0, rank="auto")

    def ours_auto() -> None:
        with auto:
            pass

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return measure({"auto": ours_auto, "none": ours_reused}, repeats, number)
    finally:
        dist.destroy_process_group()


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
    parser.add_argument(
        "--cuda",
        action="store_true",
        help="initialize CUDA first: blocks (and Lightning's isolate_rng) then save and "
        "restore every CUDA generator too; the floor row stays CPU-only",
    )
    args = parser.parse_args(argv)
    if args.cuda:
        torch.cuda.init()
    # Lightning imports it anyway; the rows marked NO_INDUCTOR hide it again.
    importlib.import_module(_CONFIG)

    cases: dict[str, Callable[[], None]] = {
        "deterministic(seed=0) block": ours_block,
        "deterministic(seed=0) block" + NO_INDUCTOR: ours_block,
        "reused deterministic object": ours_reused,
        "block with a new seed each time": ours_new_seed,
        "Snapshot.capture()+restore()": ours_snapshot,
        "@reproducible no-op call": ours_decorated,
        "@reproducible generator step": ours_generator_step,
        "floor: a block's C calls, inlined": floor_case(),
        "naive recipe (get/seed/set)": naive_recipe,
        "torch.random.fork_rng(devices=[])": fork_rng,
        **lightning_cases(),
    }
    medians = measure(cases, args.repeats, args.number)
    print(f"torch {torch.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}")
    if torch.cuda.is_initialized():
        print(f"CUDA initialized: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    print(f"median of {args.repeats} repeats x {args.number} calls, µs per call\n")
    width = max(map(len, medians))
    for name, value in medians.items():
        print(f"  {name:<{width}}  {value:8.2f}")

    block = medians["deterministic(seed=0) block"]
    plain_block = medians["deterministic(seed=0) block" + NO_INDUCTOR]
    print("\nratios (targets from issue 15):")
    lit_full = medians.get("lightning isolate_rng+seed_everything")
    lit_iso = medians.get("lightning isolate_rng")
    lit_new = medians.get("lightning isolate_rng+seed_everything(new)")
    new_seed = medians["block with a new seed each time"]
    if lit_full is not None and lit_iso is not None and lit_new is not None:
        _ratio("block / lightning isolate+seed", block / lit_full, 1 / 20)
        _ratio("  the same, inductor not imported", plain_block / lit_full, 1 / 20)
        _ratio(
            "snapshot / lightning isolate_rng",
            medians["Snapshot.capture()+restore()"] / lit_iso,
            0.1,
        )
        _ratio("new-seed block / lightning (new seed)", new_seed / lit_new, 0.1)
        _ratio(
            "floor / lightning isolate+seed",
            medians["floor: a block's C calls, inlined"] / lit_full,
            None,
        )
    else:
        print("  lightning not installed: pip install -e .[bench] for the Lightning baselines")
    _ratio("new-seed block / block", new_seed / block, 1.5)
    _ratio("generator step / block", medians["@reproducible generator step"] / block, 1.2)
    _ratio("decorated call / block", medians["@reproducible no-op call"] / block, 1.1)
    _ratio("block / floor", block / medians["floor: a block's C calls, inlined"], None)
    _ratio("block / naive recipe", block / medians["naive recipe (get/seed/set)"], None)

    small = max(3, args.repeats // 3)
    print("\nscaling (reused block, µs):")
    depths = [f"{d:>2}: {depth_cost(d, small, args.number):6.2f}" for d in (1, 4, 16)]
    rngs = [f"{n:>2}: {user_rng_cost(n, small, args.number // 4):6.2f}" for n in (0, 4, 16)]
    # (benchmarks/bench_user_rngs.py measures 0/4/16/64/256 RNGs of every kind.)
    print("  nesting depth   " + "  ".join(depths))
    print("  user RNGs       " + "  ".join(rngs))
    auto = auto_rank_costs(small, args.number)
    if auto is not None:
        print(
            f"  rank='auto' in a gloo group of one: {auto['auto']:6.2f}, rank=None "
            f"{auto['none']:6.2f}, auto / none {auto['auto'] / auto['none']:5.3f}"
        )
    print(f"\nmemory per snapshot: {snapshot_bytes()} bytes (tracemalloc, Python-side)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
