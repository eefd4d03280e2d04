"""Cost of reading and writing a CUDA generator's state, through each API torch has.

Run:  python benchmarks/bench_cuda_generators.py [--repeats N] [--number N]

A block captures and restores every initialized device's default generator.
torch offers three ways: ``get_state``/``set_state`` (a 16-byte CPU tensor:
Philox seed and offset), ``initial_seed``/``get_offset`` with
``manual_seed``/``set_offset``, and ``clone_state``/``graphsafe_set_state``
(a generator object).  This prints the median µs per call of each, next to
a whole ``deterministic(seed=0)`` block and Lightning-style
``torch.cuda.get_rng_state_all``/``set_rng_state_all``, measured in the same
run.  Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable

import torch

from deterministic_ctx import deterministic


def cases() -> dict[str, Callable[[], object]]:
    g = torch.cuda.default_generators[0]
    state = g.get_state()
    seed, offset = g.initial_seed(), g.get_offset()
    out: dict[str, Callable[[], object]] = {
        "get_state": g.get_state,
        "set_state": lambda: g.set_state(state),
        "get_state + set_state": lambda: g.set_state(g.get_state()),
        "initial_seed + get_offset": lambda: (g.initial_seed(), g.get_offset()),
        "manual_seed + set_offset": lambda: (g.manual_seed(seed), g.set_offset(offset)),
        "torch.cuda.get/set_rng_state_all": lambda: torch.cuda.set_rng_state_all(
            torch.cuda.get_rng_state_all()
        ),
        "deterministic(seed=0) block": _block,
    }
    if hasattr(g, "clone_state") and hasattr(g, "graphsafe_set_state"):
        saved = g.clone_state()
        out["clone_state + graphsafe_set_state"] = lambda: g.graphsafe_set_state(saved)
    return out


def _block() -> None:
    with deterministic(seed=0):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.cuda.init()
    table = cases()
    samples: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(args.repeats):  # interleaved: machine noise hits every row alike
        for name, fn in table.items():
            seconds = timeit.timeit(fn, number=args.number)
            samples[name].append(seconds / args.number * 1e6)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
        f"median of {args.repeats} x {args.number} calls, µs per call\n"
    )
    for name, values in samples.items():
        print(f"  {name:<36} {statistics.median(values):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
