"""Cost of ``locate_divergence(..., ops=True)`` against ``ops=False``, where the runs diverge.

Run:  python benchmarks/bench_locate_ops.py [--repeats N] [--threads N]

The MLP of ``bench_locate.py`` (6 blocks, a training step: forward, loss, backward) made to
differ between runs in three places, each by a factor drawn from ``os.urandom``:

* ``module output``: a module inside the fourth block scales its input (the op window is that
  module call);
* ``gradient``: a custom ``autograd.Function`` in the fourth block scales its gradient
  (``backward=True``; the op window is the backward pass up to the differing gradient, whose
  built-in backward ops are placed at the forward line that made their node);
* ``return value``: the step's result is scaled after the model (the whole step is recorded).

For each it prints the median wall time (ms) of ``locate_divergence`` with ``ops=False`` and
with ``ops=True``, measured alternately in the same run, and their ratio.  Nothing is asserted:
``docs/how-to/divergence.md`` quotes the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_locate import MLP  # the script's directory is on sys.path
from torch import nn

from deterministic_ctx import deterministic, locate_divergence


def urandom_scale() -> float:
    """A factor near 1 that differs from run to run (no RNG a block could seed)."""
    return 1.0 + struct.unpack("<H", os.urandom(2))[0] / 2**24


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * urandom_scale()


class ScaledGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * urandom_scale()


class GradScaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledGrad.apply(x)  # type: ignore[no-any-return]


def workload(where: str) -> tuple[nn.Module, Callable[[], Any], bool]:
    """The model, one training step, and whether the difference is in a gradient."""
    model = MLP()
    if where == "module output":
        model.blocks[3].insert(2, Scaled())
    elif where == "gradient":
        model.blocks[3].insert(2, GradScaled())
    x = torch.randn(64, 32)
    target = torch.randint(0, 10, (64,))

    def step() -> Any:
        model.zero_grad(set_to_none=True)
        out = model(x)
        loss = nn.functional.cross_entropy(out, target)
        loss.backward()
        return out * urandom_scale() if where == "return value" else out.detach()

    return model, step, where == "gradient"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"medians of {args.repeats} repeats (ms)"
    )
    print(f"{'difference in':<14} {'ops=False':>10} {'ops=True':>10} {'ratio':>7}")
    with deterministic(seed=0):  # model initialization and inputs: the same every time
        for where in ("module output", "gradient", "return value"):
            model, step, backward = workload(where)
            times: dict[bool, list[float]] = {False: [], True: []}
            for ops in (False, True):  # warm-up: first calls, lazy imports
                locate_divergence(step, reset=[model], backward=backward, ops=ops)
            for _ in range(args.repeats):
                for ops in (False, True):
                    start = time.perf_counter()
                    report = locate_divergence(step, reset=[model], backward=backward, ops=ops)
                    times[ops].append((time.perf_counter() - start) * 1e3)
                    assert report.divergence is not None, where
            off, on = (statistics.median(times[ops]) for ops in (False, True))
            print(f"{where:<14} {off:>10.1f} {on:>10.1f} {on / off:>6.2f}x")


if __name__ == "__main__":
    main()
