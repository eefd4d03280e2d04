"""Cost of locate_divergence and assert_reproducible on small models, and of one fingerprint.

Run:  python benchmarks/bench_locate.py [--device cpu|cuda] [--repeats N] [--threads N] [--large]
                                        [--floor] [--baseline CHECKOUT]

For each model and workload it prints the median wall time (ms) of:

* ``1 run``: the workload once inside a ``deterministic`` block (the unit of cost);
* ``assert_reproducible``: two runs and an exact comparison of the results;
* ``locate``: ``locate_divergence`` with forward hooks (two runs that agree);
* ``locate+bw``: the same with gradient fingerprints (``backward=True``);

then each of the last three as a multiple of one run (``x1``), and the hook overhead per
module call: (locate - 2 x one run) / (2 x calls).  The targets of issue #15 follow, for the
MLP: ``locate`` at most 3x one run, ``locate+bw`` at most 5x, each marked ``ok`` or
``MISSED``.  A last table compares one fingerprint (``fingerprint_parts``, what locate
computes per tensor) with a float sum and with copying the tensor (``clone``, and ``.cpu()``
on a GPU), by tensor size.  Rows are interleaved across repeats so machine noise hits all
alike; on a shared machine, ``--threads 1`` gives steadier numbers.

``--floor`` adds ``locate`` with every fingerprint left out (what the hooks, the
bookkeeping, saving and restoring the model and the comparison cost alone).
``--baseline CHECKOUT`` adds ``assert_reproducible``, ``locate`` and ``locate+bw`` of
another copy of the package (a checkout's root, or its ``deterministic_ctx`` directory),
imported under another name and measured in the same run, interleaved: before and after
a change, in the same conditions.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from deterministic_ctx import assert_reproducible, deterministic, locate_divergence
from deterministic_ctx.verify.fingerprint import FingerprintStore, fingerprint_parts

#: Issue #15: locate_divergence on the MLP at most this many times one run of the workload.
TARGETS = {"locate": 3.0, "locate+bw": 5.0}


class MLP(nn.Module):
    """Pre-norm residual MLP: 6 blocks of LayerNorm, Linear, GELU, Dropout (26 module calls)."""

    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(32, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class CNN(nn.Module):
    """6 conv blocks (Conv2d, BatchNorm2d, ReLU in place), pooling, a linear head."""

    def __init__(self, channels: int = 32, depth: int = 6) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [
                nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1),
                nn.BatchNorm2d(channels),
                nn.ReLU(inplace=True),
            ]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def workloads(
    device: torch.device, large: bool = False
) -> list[tuple[str, nn.Module, Callable[[], object]]]:
    models = [
        ("mlp 256x6, batch 128", MLP(), torch.randn(128, 32)),
        ("cnn 32ch x6, 16x3x32x32", CNN(), torch.randn(16, 3, 32, 32)),
    ]
    if large:  # a few million parameters: 6 x (1024 x 1024) linear layers, 6.3M
        models.append(("mlp 1024x6 (6.3M), batch 512", MLP(1024), torch.randn(512, 32)))
    out = []
    for name, model, x in models:
        model, x = model.to(device), x.to(device)
        target = torch.randint(0, 10, (x.shape[0],), device=device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def forward(model=model, x=x):
            with torch.no_grad():
                return model(x)

        def train_step(model=model, x=x, target=target, opt=opt):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            return loss.detach()

        out.append((f"{name}, forward", model, forward))
        out.append((f"{name}, train step", (model, opt), train_step))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def load_baseline(checkout: str) -> tuple[Callable[..., object], Callable[..., object]]:
    """``(locate_divergence, assert_reproducible)`` of the package in ``checkout`` (its root or
    the package directory), copied to a temporary directory and imported under another name,
    ``deterministic_ctx_baseline``."""
    source = Path(checkout)
    if (source / "deterministic_ctx").is_dir():
        source = source / "deterministic_ctx"
    if not (source / "locate.py").is_file():
        raise SystemExit(f"--baseline: no deterministic_ctx package in {checkout}")
    where = Path(tempfile.mkdtemp(prefix="bench_locate_"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    shutil.copytree(source, where / "deterministic_ctx_baseline")
    sys.path.insert(0, str(where))
    locate: ModuleType = importlib.import_module("deterministic_ctx_baseline.locate")
    verify: ModuleType = importlib.import_module("deterministic_ctx_baseline.verify")
    return locate.locate_divergence, verify.assert_reproducible


@contextlib.contextmanager
def no_fingerprints() -> Iterator[None]:
    """Every fingerprint left out (``None``: no data), the rest of locate as it is."""
    add, add_all = FingerprintStore.add, FingerprintStore.add_all
    FingerprintStore.add = lambda self, t: None  # type: ignore[method-assign]
    FingerprintStore.add_all = lambda self, ts: [None for _ in ts]  # type: ignore[method-assign]
    try:
        yield
    finally:
        FingerprintStore.add, FingerprintStore.add_all = add, add_all  # type: ignore[method-assign]


def baseline_rows(
    baseline: tuple[Callable[..., object], Callable[..., object]],
    fn: Callable[[], object],
    reset: list[object],
) -> dict[str, Callable[[], object]]:
    """The rows of the baseline package for the workload ``fn``."""
    locate, assert_r = baseline
    return {
        "assert_r base": lambda: assert_r(fn, reset=reset),
        "locate base": lambda: locate(fn, reset=reset),
        "locate+bw base": lambda: locate(fn, reset=reset, backward=True),
    }


def bench_workloads(
    device: torch.device,
    repeats: int,
    large: bool = False,
    floor: bool = False,
    baseline: tuple[Callable[..., object], Callable[..., object]] | None = None,
) -> list[tuple[str, str, float]]:
    """Print the table of workloads; return ``(workload, row, ratio to one run)`` of the MLP."""
    extra = (["floor"] if floor else []) + (
        ["assert_r base", "locate base", "locate+bw base"] if baseline else []
    )
    print(
        f"{'workload':<38} {'calls':>5} {'1 run':>7} {'assert_r':>8} {'locate':>7} "
        f"{'locate+bw':>9} {'x1':>5} {'x1 bw':>5} {'µs/call':>7} {'µs/call bw':>10}"
        + "".join(f" {k:>14}" for k in extra)
    )
    ratios: list[tuple[str, str, float]] = []
    for name, state, fn in workloads(device, large):
        reset = list(state) if isinstance(state, tuple) else [state]
        block = deterministic(seed=0)

        def one_run(fn=fn, block=block):
            with block:
                fn()

        def floor_run(fn=fn, reset=reset):
            with no_fingerprints():
                locate_divergence(fn, reset=reset)

        rows: dict[str, Callable[[], object]] = {
            "1 run": one_run,
            "assert_r": lambda fn=fn, reset=reset: assert_reproducible(fn, reset=reset),
            "locate": lambda fn=fn, reset=reset: locate_divergence(fn, reset=reset),
            "locate+bw": lambda fn=fn, reset=reset: locate_divergence(
                fn, reset=reset, backward=True
            ),
        }
        if floor:
            rows["floor"] = floor_run
        if baseline is not None:
            rows.update(baseline_rows(baseline, fn, reset))
        report = locate_divergence(fn, reset=reset, backward=True)
        assert report.agree, report
        for row in rows.values():  # warm up: lazy imports, allocator, kernels
            row()
        samples: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(repeats):
            for key, row in rows.items():
                samples[key].append(timed(row, device))
        med = {k: statistics.median(v) for k, v in samples.items()}
        calls = report.calls
        per_call = (med["locate"] - 2 * med["1 run"]) / (2 * calls) * 1e3
        per_call_bw = (med["locate+bw"] - 2 * med["1 run"]) / (2 * calls) * 1e3
        x1 = {k: med[k] / med["1 run"] for k in TARGETS}
        print(
            f"{name:<38} {calls:>5} {med['1 run']:>7.2f} {med['assert_r']:>8.2f} "
            f"{med['locate']:>7.2f} {med['locate+bw']:>9.2f} {x1['locate']:>5.2f} "
            f"{x1['locate+bw']:>5.2f} {per_call:>7.0f} {per_call_bw:>10.0f}"
            + "".join(f" {med[k]:>7.2f} {med[k] / med['1 run']:>5.2f}x" for k in extra)
        )
        if name.startswith("mlp 256"):
            ratios += [(name, key, ratio) for key, ratio in x1.items()]
    return ratios


def print_targets(ratios: list[tuple[str, str, float]]) -> None:
    print()
    print("targets (issue #15), medians as multiples of one run of the same workload:")
    for name, key, ratio in ratios:
        target = TARGETS[key]
        verdict = "ok" if ratio <= target else "MISSED"
        print(f"  {name:<38} {key:<9} {ratio:>5.2f}x  target <= {target:.1f} {verdict}")


def bench_fingerprint(device: torch.device, repeats: int) -> None:
    print()
    print(
        f"{'float32 elements':>16} {'fingerprint µs':>15} {'float sum µs':>13} "
        f"{'clone µs':>10} {'.cpu() µs':>10}"
    )
    for numel in (1_000, 100_000, 1_000_000, 10_000_000):
        t = torch.randn(numel, device=device)
        rows: dict[str, Callable[[], object]] = {
            "fingerprint": lambda t=t: fingerprint_parts(t),
            "sum": t.sum,
            "clone": t.clone,
            "cpu": t.cpu,
        }
        for row in rows.values():
            row()
        samples: dict[str, list[float]] = {k: [] for k in rows}
        for _ in range(repeats):
            for key, row in rows.items():
                samples[key].append(timed(row, device) * 1e3)
        med = {k: statistics.median(v) for k, v in samples.items()}
        cpu = f"{med['cpu']:>10.0f}" if device.type != "cpu" else f"{'-':>10}"
        print(
            f"{numel:>16,} {med['fingerprint']:>15.0f} {med['sum']:>13.0f} "
            f"{med['clone']:>10.0f} {cpu}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--large", action="store_true", help="add an MLP of 6.3M parameters (batch 512)"
    )
    parser.add_argument(
        "--floor", action="store_true", help="add locate with every fingerprint left out"
    )
    parser.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="add the rows of another copy of the package, measured in the same run",
    )
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} CPU threads, "
        f"medians of {args.repeats} repeats (ms unless marked)"
    )
    with deterministic(seed=0):  # model initialization and inputs: the same every time
        ratios = bench_workloads(device, args.repeats, args.large, args.floor, baseline)
        print_targets(ratios)
        bench_fingerprint(device, args.repeats)


if __name__ == "__main__":
    main()
