"""Per-sample keyed randomness (issue 35): what a keyed item and a keyed epoch cost.

    python benchmarks/bench_keyed.py [--rounds 15] [--items 2000] [--workers 0 2]

Every row is measured in the same run as its baseline, interleaved round by round, and
reported as a median (µs), with the ratio to the baseline's median:

* **per item**, against the classic per-sample recipe ``random.seed(i); np.random.seed(i);
  torch.manual_seed(i)`` (target: a keyed item <= 0.25 of it): ``SeededDataset`` over a
  dataset that returns its index, one item at a time and in batches of 32 (``__getitems__``,
  what a ``DataLoader`` calls), with no registered RNG and with four; the seeding floor (the
  three seeding calls an item cannot skip, nothing captured or restored); a
  ``deterministic(seed=i)`` block (what the issue compares with); and the parts that
  chose the design: each seeding call (``random.seed``, ``np.random.seed``,
  ``torch.manual_seed`` against ``torch.default_generator.manual_seed``), the refill a
  Mersenne Twister's first draw after seeding costs, NumPy's public ``get_state()`` +
  ``set_state()`` against the capture and restore a block uses, ``derive_seed`` against the
  SplitMix64 step from a per-epoch base.
* **per epoch** of a ``DataLoader`` over a light augmentation (a random crop of a padded
  3x32x32 image, a flip, noise and a brightness factor from NumPy), batch size 32, against
  the same loop unkeyed (the plain dataset, a ``RandomSampler`` with its own generator;
  target: keyed <= 1.15x), and the same loop over the seeding floor (a wrapper that seeds
  the three generators per item from its key and restores nothing: what any keyed item
  must pay), for each ``--workers`` count (persistent workers, started before timing) and
  each image ``--sizes`` (32: CIFAR's; 128: a mid-size crop), with ``--threads`` torch
  threads (1, as in a worker).  Wall time; with ``num_workers=0`` also the main process's
  CPU time, which other jobs on a shared machine disturb less.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from deterministic_ctx import (
    SeededDataset,
    SeededIndex,
    SeededSampler,
    derive_seed,
    deterministic,
    register_rng,
    unregister_rng,
)
from deterministic_ctx.internal import source_named


class Index(Dataset):
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> int:
        return i


_PY_SEED = random.Random.__mro__[1].seed  # the C seeding of random.seed(int)


class Floor(Dataset):
    """The seeding floor of a keyed batch: each item's key, then ``random``, NumPy's global
    RNG and torch's CPU generator seeded from it as ``SeededDataset`` seeds them, in one
    tight loop per batch, and nothing captured or restored (the benchmark runs inside a
    block)."""

    def __init__(self, keyed: SeededDataset) -> None:
        self.keyed = keyed

    def __len__(self) -> int:
        return len(self.keyed)

    def __getitems__(self, indices: list[SeededIndex]) -> list[object]:
        key, inner = self.keyed._key, self.keyed.dataset
        py, rs, gen = random._inst, np.random.mtrand._rand, torch.default_generator
        out = []
        for index in indices:
            i = int(index)
            k = key(i, index.epoch)
            _PY_SEED(py, k)
            py.gauss_next = None
            rs.seed(k)
            gen.manual_seed(k)
            out.append(inner[i])
        return out


class Light(Dataset):
    """A light augmentation of a 3 x size x size image: pad-and-crop, flip, noise, brightness
    (CIFAR's recipe at 32, with noise and brightness added)."""

    def __init__(self, n: int = 2048, size: int = 32) -> None:
        self.images = torch.rand(n, 3, size, size)
        self.size = size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.nn.functional.pad(self.images[i], (4, 4, 4, 4))
        top, left = torch.randint(0, 9, (2,)).tolist()
        x = x[:, top : top + self.size, left : left + self.size]
        if random.random() < 0.5:
            x = x.flip(2)
        x = x + 0.01 * torch.randn_like(x)
        return x * float(np.random.uniform(0.8, 1.2))


def per_call(fn: Callable[[int], object], n: int, offset: int) -> float:
    start = time.perf_counter()
    for i in range(offset, offset + n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def bench_items(rounds: int, n: int) -> None:
    keyed = SeededDataset(Index(), seed=0)
    numpy_source = source_named("numpy")
    gen = torch.default_generator
    rs = np.random.mtrand._rand
    base = derive_seed(0, "item", 1, bits=64)

    def recipe(i: int) -> None:
        random.seed(i)
        np.random.seed(i)
        torch.manual_seed(i)

    def item(i: int) -> None:
        keyed[SeededIndex(i, 1)]

    def batched(i: int) -> None:
        if i % 32 == 0:  # one call per 32 items, timed per item
            keyed.__getitems__([SeededIndex(j, 1) for j in range(i, i + 32)])

    py = random._inst

    def floor(i: int) -> None:
        _PY_SEED(py, i)
        py.gauss_next = None
        rs.seed(i)
        gen.manual_seed(i)

    def python_seed(i: int) -> None:
        random.seed(i)

    def python_c_seed(i: int) -> None:
        _PY_SEED(py, i)

    def python_refill(i: int) -> None:
        _PY_SEED(py, i)
        py.random()

    def numpy_seed(i: int) -> None:
        np.random.seed(i)

    def numpy_refill(i: int) -> None:
        rs.seed(i)
        rs.random_sample()

    def block(i: int) -> None:
        with deterministic(seed=i & 0xFFFF_FFFF):
            pass

    def numpy_public(i: int) -> None:
        rs.set_state(rs.get_state())

    def numpy_source_path(i: int) -> None:
        numpy_source.restore(numpy_source.capture())

    def torch_manual_seed(i: int) -> None:
        torch.manual_seed(i)

    def generator_manual_seed(i: int) -> None:
        gen.manual_seed(i)

    def derive(i: int) -> None:
        derive_seed(0, "item", 1, i)

    def splitmix(i: int) -> None:
        m = 2**64 - 1
        z = (base + (i + 1) * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        _ = (z ^ (z >> 31)) >> 32

    def register() -> list[object]:
        made = [random.Random(), np.random.default_rng(), torch.Generator(), random.Random()]
        return [register_rng(r, key=f"bench{k}") for k, r in enumerate(made)]

    rows: dict[str, Callable[[int], None]] = {
        "recipe: random.seed; np.random.seed; torch.manual_seed": recipe,
        "keyed item (SeededDataset)": item,
        "keyed item, batches of 32 (__getitems__)": batched,
        "keyed item, 4 registered RNGs": item,  # registered around this row only
        "keyed item, 4 registered RNGs, batches of 32": batched,
        "seeding floor: the three seeding calls": floor,
        "deterministic(seed=i) block": block,
        "random.seed(i)": python_seed,
        "random.Random's C seed(i) (what an item uses)": python_c_seed,
        "  ... and a first draw (the 624-word refill)": python_refill,
        "np.random.seed(i)": numpy_seed,
        "RandomState.seed(i) and a first draw (refill)": numpy_refill,
        "NumPy get_state() + set_state()": numpy_public,
        "NumPy source capture() + restore()": numpy_source_path,
        "torch.manual_seed(i)": torch_manual_seed,
        "torch.default_generator.manual_seed(i)": generator_manual_seed,
        "derive_seed(0, 'item', 1, i)": derive,
        "SplitMix64 step": splitmix,
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    offset = 0
    n -= n % 32  # whole batches for the batched rows
    with deterministic(seed=0, flags=False):  # the recipe's seeds do not outlive the run
        for _ in range(rounds):
            for name, fn in rows.items():
                registered = register() if "registered" in name else []
                try:
                    times[name].append(per_call(fn, n, offset))
                finally:
                    for rng in registered:
                        unregister_rng(rng)
                offset += n
    baseline = statistics.median(times["recipe: random.seed; np.random.seed; torch.manual_seed"])
    print(f"per item ({rounds} rounds of {n}, medians)")
    for name, values in times.items():
        m = statistics.median(values)
        print(f"  {name:58s} {m:8.2f} µs  {m / baseline:6.3f} of the recipe")


def bench_epochs(rounds: int, workers: int, size: int) -> None:
    dataset = Light(n=2048 if size <= 32 else 256, size=size)
    keyed = SeededDataset(dataset, seed=0)
    samplers = [SeededSampler(keyed, seed=0), SeededSampler(keyed, seed=0)]
    common = {"batch_size": 32, "num_workers": workers, "generator": torch.Generator()}
    if workers:
        common["persistent_workers"] = True
    loaders = {
        "unkeyed (RandomSampler)": DataLoader(
            dataset, sampler=RandomSampler(dataset, generator=torch.Generator()), **common
        ),
        "keyed (SeededDataset + SeededSampler)": DataLoader(keyed, sampler=samplers[0], **common),
        "seeding floor (keys and 3 seeds per item, no restore)": DataLoader(
            Floor(keyed), sampler=samplers[1], **common
        ),
    }
    for loader in loaders.values():  # start the workers, warm the caches
        for _ in loader:
            pass
    names = list(loaders)
    wall: dict[str, list[float]] = {name: [] for name in loaders}
    cpu: dict[str, list[float]] = {name: [] for name in loaders}
    with deterministic(seed=0, flags=False):
        for epoch in range(rounds):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            names = names[1:] + names[:1]  # each loader takes each place in turn
            for name in names:
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in loaders[name]:
                    pass
                wall[name].append((time.perf_counter() - start) * 1e3)
                cpu[name].append((time.process_time() - start_cpu) * 1e3)
    print(
        f"DataLoader epoch of {len(dataset)} light items of 3x{size}x{size}, "
        f"num_workers={workers} ({rounds} rounds, medians; wall"
        + (", and the main process's CPU time)" if not workers else ")")
    )
    unkeyed = statistics.median(wall["unkeyed (RandomSampler)"])
    unkeyed_cpu = statistics.median(cpu["unkeyed (RandomSampler)"])
    for name in loaders:
        m = statistics.median(wall[name])
        line = f"  {name:58s} {m:8.1f} ms  {m / unkeyed:6.3f} of unkeyed"
        if not workers:
            c = statistics.median(cpu[name])
            line += f"   CPU {c:8.1f} ms  {c / unkeyed_cpu:6.3f}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="*", default=[0, 2])
    parser.add_argument("--sizes", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    # DataLoader workers run with one thread; the main process with more would time its
    # threads' contention on a shared machine (11 ms an item at 128 px on 2 busy cores).
    torch.set_num_threads(args.threads)
    print(
        f"Python {'.'.join(map(str, __import__('sys').version_info[:3]))}, torch "
        f"{torch.__version__}, NumPy {np.__version__}"
    )
    bench_items(args.rounds, args.items)
    for size in args.sizes:
        for workers in args.workers:
            bench_epochs(args.rounds, workers, size)


if __name__ == "__main__":
    main()
