#!/usr/bin/env python3
"""One command that proves a GPU: everything this project checks on a CUDA device, one summary.

Run it in the project's environment (torch with CUDA, the ``test`` extra installed)::

    python tools/gpu_check.py                 # everything, the suite with pytest -n auto
    python tools/gpu_check.py --quick         # the suite's quick part, a short benchmark
    python tools/gpu_check.py --suite-args "tests/core -n 4"   # another suite run

Its steps, in this order:

1. **determinism**: a small training loop (random init, dropout, ``index_add_``, whose
   CUDA kernel uses atomics, SGD) run twice in ``deterministic(seed=0)`` must give
   bitwise equal losses and weights, twice without a block different ones (so the
   equality is the block's doing), and the caller's generator state must be the same
   after the blocks as before.  It runs first, in this process, so that CUDA and
   cuBLAS are first used inside a block (``CUBLAS_WORKSPACE_CONFIG`` is read once).
   **exemption**: ``allow_nondeterministic`` on real CUDA ops without a deterministic
   kernel (the backward of ``F.interpolate(mode="bicubic")``, ``histc``, ``kthvalue``:
   those this torch refuses): refused in a block, run with the exemption, another refused
   op still refused inside it, no warning under ``warn_only=True``, the flags as before
   (``--exemption-only``: these two steps alone).
2. **gpu tests**: ``pytest -m gpu -n 0`` (one device: the tests run one at a time).
3. **suite**: the whole suite with xdist (``-n auto``; ``--quick``: ``-m "not slow"``).
4. **benchmark**: with CUDA initialized, the median µs of ``with deterministic(seed=0)``,
   ``with isolated()`` and ``with torch.random.fork_rng(devices=[0])``, interleaved
   (``benchmarks/bench_blocks.py --cuda`` has the full table).

Without a CUDA device it still runs, and says what it left out: the GPU tests are skipped,
the determinism loop and the benchmark run on the CPU (``fork_rng(devices=[])``), which
proves the tool itself but nothing of a GPU.  The exit status is 1 when any step failed
(a skipped one is no failure), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Step:
    name: str
    status: str  # "passed", "failed" or "skipped"
    detail: str
    seconds: float = 0.0


def log(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


# -- 1. determinism -----------------------------------------------------------------------


def _train(device: str, steps: int) -> tuple[list[float], list[object]]:
    """A few SGD steps of a small model on ``device``: the losses and the final weights.

    Every random number comes from the global generators (init, data, dropout), and
    ``index_add_`` accumulates with atomics on CUDA unless deterministic algorithms are on.
    """
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 8)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: list[float] = []
    for _ in range(steps):
        x = torch.randn(256, 32, device=device)
        target = torch.randn(256, 8, device=device)
        out = model(x)
        index = torch.randint(0, 16, (256,), device=device)
        pooled = torch.zeros(16, 8, device=device).index_add_(0, index, out)
        loss = torch.nn.functional.mse_loss(out, target) + pooled.square().mean() * 1e-3
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


def _same(a: tuple[list[float], list[object]], b: tuple[list[float], list[object]]) -> bool:
    import torch

    return a[0] == b[0] and all(
        torch.equal(x, y)  # type: ignore[arg-type]
        for x, y in zip(a[1], b[1], strict=True)
    )


def determinism_check(device: str, steps: int) -> Step:
    import torch

    from deterministic_ctx import deterministic

    def generator_state() -> object:
        return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()

    started = time.monotonic()
    if device == "cuda":
        torch.cuda.init()  # type: ignore[no-untyped-call]
    before = generator_state()
    runs = []
    for _ in range(2):
        with deterministic(seed=0):
            runs.append(_train(device, steps))
    after = generator_state()
    plain = [_train(device, steps), _train(device, steps)]
    problems = []
    if not _same(runs[0], runs[1]):
        problems.append("two runs in deterministic(seed=0) differ")
    if _same(plain[0], plain[1]):
        problems.append("two runs without a block are equal (the check proves nothing)")
    if not torch.equal(before, after):  # type: ignore[arg-type]
        problems.append(f"the blocks did not restore the {device} generator")
    detail = (
        f"{steps} training steps on {device}: bitwise equal twice in a block, "
        "different without one, the generator restored"
    )
    status = "failed" if problems else "passed"
    return Step("determinism", status, "; ".join(problems) or detail, time.monotonic() - started)


# -- 1b. one op exempted ---------------------------------------------------------------------


def _exemption_candidates(device: str) -> list[tuple[str, Callable[[], object]]]:
    """Real ops without a deterministic CUDA kernel in some torch: ``(op name, a call of it)``.

    Each call makes its tensors fresh (inside the block, on ``device``).  The first is the
    headline of issue 43: a backward op, which CUDA runs on autograd's own threads.
    """
    import torch
    import torch.nn.functional as F

    def bicubic_backward() -> object:
        image = torch.randn(1, 3, 16, 16, device=device, requires_grad=True)
        F.interpolate(image, scale_factor=2, mode="bicubic").sum().backward()  # type: ignore[no-untyped-call]
        return image.grad

    def histc() -> object:
        return torch.histc(torch.randn(1000, device=device), bins=10)

    def kthvalue() -> object:
        return torch.randn(100, device=device).kthvalue(3)

    return [
        ("aten::upsample_bicubic2d_backward", bicubic_backward),
        ("aten::histc", histc),
        ("aten::kthvalue", kthvalue),
    ]


def _refused(call: Callable[[], object]) -> bool:
    try:
        call()
    except RuntimeError as exc:
        if "does not have a deterministic implementation" in str(exc):
            return True
        raise
    return False


def exemption_check(device: str) -> Step:
    """``allow_nondeterministic`` on real CUDA ops: each op that torch refuses in a block
    runs with the exemption, with the check still on for the other ops (another refused
    op is refused inside the same exemption), no warning under ``warn_only=True``, and
    the flags as before once the block is left."""
    import warnings

    import torch

    from deterministic_ctx import allow_nondeterministic, deterministic

    started = time.monotonic()
    if device != "cuda":
        return Step("exemption", "skipped", "no CUDA device: no op of torch alerts on the CPU", 0.0)
    flags_before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    problems: list[str] = []
    refused: list[tuple[str, Callable[[], object]]] = []
    not_alerting_names: list[str] = []
    for name, call in _exemption_candidates(device):
        with deterministic(seed=0):
            if _refused(call):
                refused.append((name, call))
            else:
                not_alerting_names.append(name)
    if not refused:
        return Step(
            "exemption",
            "skipped",
            f"no candidate op is refused by this torch ({', '.join(not_alerting_names)})",
            time.monotonic() - started,
        )
    for i, (name, call) in enumerate(refused):
        others = [c for j, (_, c) in enumerate(refused) if j != i]
        with deterministic(seed=0):
            with allow_nondeterministic(name):
                try:
                    call()
                except RuntimeError as exc:
                    problems.append(f"{name} refused inside its exemption: {exc}")
                if not torch.are_deterministic_algorithms_enabled():
                    problems.append(f"the check stayed off after an exempted {name}")
                for other in others:  # the rest of the step is still checked
                    if not _refused(other):
                        problems.append(f"another op ran unchecked inside {name}'s exemption")
            if not _refused(call):
                problems.append(f"{name} ran unchecked after its exemption ended")
        with deterministic(seed=0, warn_only=True), allow_nondeterministic(name):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call()
            alerts = [w for w in caught if "deterministic implementation" in str(w.message)]
            if alerts:
                problems.append(f"{name} warned inside its exemption under warn_only=True")
    flags_after = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if flags_after != flags_before:
        problems.append(f"the flags are {flags_after} after the blocks, {flags_before} before")
    names = ", ".join(n for n, _ in refused)
    detail = (
        f"refused in a block, run with allow_nondeterministic, the other ops still refused, no "
        f"warning under warn_only: {names}"
    )
    if not_alerting_names:
        detail += f" (not refused by this torch: {', '.join(not_alerting_names)})"
    status = "failed" if problems else "passed"
    return Step("exemption", status, "; ".join(problems) or detail, time.monotonic() - started)


# -- 2. and 3. pytest runs -----------------------------------------------------------------


def run_pytest(name: str, args: list[str]) -> Step:
    """Run pytest in the checkout with this interpreter, echoing its output; its summary."""
    command = [sys.executable, "-m", "pytest", *args]
    log(f"{name}: {shlex.join(command)}")
    started = time.monotonic()
    lines: list[str] = []
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        lines.append(line)
    status = process.wait()
    summary = _pytest_summary(lines)
    # 5: no test was collected (e.g. no GPU test selected), which is not a failure of the device.
    verdict = "passed" if status in (0, 5) else "failed"
    return Step(name, verdict, f"{summary} (exit {status})", time.monotonic() - started)


def _pytest_summary(lines: list[str]) -> str:
    for line in reversed(lines):
        stripped = line.strip().strip("=").strip()
        if re.search(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b", stripped):
            return stripped
    return "(no pytest summary)"


# -- 4. benchmark ---------------------------------------------------------------------------


def benchmark(device: str, repeats: int, number: int) -> tuple[Step, dict[str, float]]:
    import torch

    from deterministic_ctx import deterministic, isolated

    started = time.monotonic()
    devices = [0] if device == "cuda" else []
    block = deterministic(seed=0)

    def ours() -> None:
        with block:
            pass

    def ours_isolated() -> None:
        with isolated():
            pass

    def fork_rng() -> None:
        with torch.random.fork_rng(devices=devices):
            pass

    cases: dict[str, Callable[[], None]] = {
        "with deterministic(seed=0)": ours,
        "with isolated()": ours_isolated,
        f"with torch.random.fork_rng(devices={devices})": fork_rng,
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm up: first-use imports and caches stay out of the figures
    for _ in range(repeats):  # interleaved: the machine's noise hits every row alike
        for name, fn in cases.items():
            samples[name].append(timeit.timeit(fn, number=number) / number * 1e6)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    where = (
        f"CUDA initialized, {torch.cuda.get_device_name(0)}"
        if device == "cuda"
        else "CPU only (no CUDA device)"
    )
    detail = f"{where}; " + ", ".join(f"{k}: {v:.1f} µs" for k, v in medians.items())
    return Step("benchmark", "passed", detail, time.monotonic() - started), medians


# -- the run ----------------------------------------------------------------------------------


def environment() -> tuple[str, str]:
    """``(device, description)``: ``"cuda"`` where a CUDA device is usable, else ``"cpu"``."""
    import numpy as np
    import torch

    versions = (
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, NumPy {np.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    if torch.cuda.is_available():
        # get_device_name initializes CUDA: read the device facts after the determinism step.
        return (
            "cuda",
            f"{versions}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)",
        )
    reason = "torch built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
    return "cpu", f"{versions}; {reason}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/gpu_check.py", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the suite's quick part (-m 'not slow'), fewer training steps, a short benchmark",
    )
    parser.add_argument(
        "--suite-args",
        metavar="ARGS",
        help="pytest arguments for the suite step instead of the default (-n auto, or with "
        "--quick -m 'not slow' -n auto), as one shell-quoted string",
    )
    parser.add_argument("--skip-suite", action="store_true", help="leave the suite step out")
    parser.add_argument(
        "--exemption-only",
        action="store_true",
        help="run the determinism and exemption steps only (allow_nondeterministic on real ops)",
    )
    parser.add_argument(
        "--gpu-tests-args",
        metavar="ARGS",
        help="pytest arguments for the GPU tests instead of -m gpu -n 0",
    )
    options = parser.parse_args(argv)

    device, described = environment()
    log(described)
    steps: list[Step] = []
    training_steps = 5 if options.quick else 30
    repeats, number = (3, 50) if options.quick else (9, 1000)

    def record(step: Step) -> None:
        steps.append(step)
        log(f"{step.name}: {step.status}: {step.detail}")

    try:
        record(determinism_check(device, training_steps))
    except Exception as exc:  # the summary must still come
        record(Step("determinism", "failed", f"{type(exc).__name__}: {exc}"))
    if device != "cuda":
        steps[-1].detail += " (on the CPU: no CUDA device, the CUDA check was not made)"
    try:
        record(exemption_check(device))
    except Exception as exc:
        record(Step("exemption", "failed", f"{type(exc).__name__}: {exc}"))
    if options.exemption_only:
        return _summary(steps, described, device)

    gpu_args = shlex.split(options.gpu_tests_args or "-m gpu -n 0")
    if device == "cuda":
        record(run_pytest("gpu tests", gpu_args))
    else:
        record(Step("gpu tests", "skipped", "no CUDA device: the GPU-marked tests were not run"))

    if options.skip_suite:
        record(Step("suite", "skipped", "--skip-suite"))
    else:
        default = ["-m", "not slow", "-n", "auto"] if options.quick else ["-n", "auto"]
        suite = shlex.split(options.suite_args) if options.suite_args else default
        record(run_pytest("suite", suite))

    try:
        step, _ = benchmark(device, repeats, number)
        if device != "cuda":
            step.detail += " (fork_rng(devices=[0]) and a block with CUDA in use: not measured)"
        record(step)
    except Exception as exc:
        record(Step("benchmark", "failed", f"{type(exc).__name__}: {exc}"))

    return _summary(steps, described, device)


def _summary(steps: list[Step], described: str, device: str) -> int:
    print()
    print(f"gpu_check summary ({described})")
    if device == "cuda":
        import torch

        print(f"  device: {torch.cuda.get_device_name(0)}")
    for step in steps:
        print(f"  {step.name:<12} {step.status.upper():<8} {step.seconds:7.1f} s  {step.detail}")
    failed = [s.name for s in steps if s.status == "failed"]
    skipped = [s.name for s in steps if s.status == "skipped"]
    verdict = f"FAILED: {', '.join(failed)}" if failed else "OK"
    if skipped:
        verdict += f" (skipped: {', '.join(skipped)})"
    print(f"  result: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
