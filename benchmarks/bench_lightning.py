"""What ``LightningCallback`` costs per training step (issue 41; target: <= 3%).

    python benchmarks/bench_lightning.py [--rounds 7] [--items 960] [--workers 2]

The tiny model and augmented dataset of ``examples/lightning_resume.py`` (Linear + ReLU +
Dropout + Linear, items augmented with ``random``, NumPy and torch), batch size 8, ``--workers``
persistent workers, one epoch per fit.  Each round fits once without the callback and once with
it, in alternating order; the time of a step is the epoch's wall time (from
``on_train_epoch_start`` to ``on_train_epoch_end``: the steps, their fetches and the callback's
hooks, not the trainer's setup or the workers' start) over its steps.  Reported: the median of
each, and the median of the per-round ratios (with the callback / without).

The callback's own cost is also timed directly, as the 2% differences drown in the rounds'
spread on a shared machine: its two per-step hooks (``on_train_batch_start``, which reseeds
the block around training, and ``on_train_batch_end``), and Lightning's dispatch of the
per-step hooks (``_call_callback_hooks``: each callback's hook method, called in a profiler
context) with and without the callback; the difference less the hooks is what Lightning's
dispatch spends on the callback's presence, counted apart from the callback's own code.  And
the workers' CPU time a step (``RUSAGE_CHILDREN`` over the fit, their start included): the
keyed items (each seeded from its key, the process's state put back once a batch) run there.
"""

from __future__ import annotations

import argparse
import resource
import runpy
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.trainer import call
from torch.utils.data import DataLoader

from deterministic_ctx import LightningCallback

EXAMPLE = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "lightning_resume.py"))


class Items(EXAMPLE["Noisy"]):  # type: ignore[misc]
    """The example's dataset, ``n`` items long."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Clock(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        self.start = time.perf_counter(), time.process_time()

    def on_train_epoch_end(self, trainer, pl_module):
        self.seconds = time.perf_counter() - self.start[0], time.process_time() - self.start[1]


def timed(callback: LightningCallback, spent: dict[str, list[float]]) -> LightningCallback:
    """``callback`` with its two per-step hooks timed into ``spent[name]``."""
    for name in ("on_train_batch_start", "on_train_batch_end"):
        hook = getattr(callback, name)
        times = spent.setdefault(name, [])

        def wrapper(*args, _hook=hook, _spent=times, **kwargs):
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                _spent.append(time.perf_counter() - start)

        setattr(callback, name, wrapper)
    return callback


#: The hooks Lightning calls on every callback once a training batch (one optimizer step each).
PER_STEP = frozenset(
    {
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "on_train_batch_end",
    }
)
DISPATCH: list[float] = []  # seconds in Lightning's dispatch of PER_STEP, this fit


def timed_dispatch() -> None:
    """Time Lightning's dispatch of the per-step callback hooks into ``DISPATCH``."""
    dispatch = call._call_callback_hooks

    def wrapper(trainer, hook_name, *args, **kwargs):
        if hook_name not in PER_STEP:
            return dispatch(trainer, hook_name, *args, **kwargs)
        start = time.perf_counter()
        try:
            return dispatch(trainer, hook_name, *args, **kwargs)
        finally:
            DISPATCH.append(time.perf_counter() - start)

    call._call_callback_hooks = wrapper


#: The runs compared: none (plain), Lightning's ``Trainer(deterministic=True)`` (the flags a
#: reproducible run sets anyway), and the callback (which sets them itself).
KINDS = ("plain", "deterministic", "callback")


def step_time(
    kind: str, items: int, workers: int, hooks: dict[str, list[float]]
) -> tuple[float, float, float, float]:
    """Wall and main-process CPU seconds per training step of one epoch, the seconds a step
    spent in Lightning's dispatch of the per-step hooks, and the workers' CPU seconds per
    step (their start included); the callback's per-step hooks' seconds are appended to
    ``hooks[name]``."""
    L.seed_everything(0, verbose=False)
    model = EXAMPLE["Model"](workers)
    loader = DataLoader(
        Items(items),
        batch_size=8,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    clock = Clock()
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[
            clock,
            *([timed(LightningCallback(seed=0), hooks)] if kind == "callback" else []),
        ],
        deterministic=kind == "deterministic",  # False: each run sets the flags it measures
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    DISPATCH.clear()
    before = _children_cpu()
    trainer.fit(model, train_dataloaders=loader)
    wall, cpu = clock.seconds
    steps = trainer.global_step
    # The workers' CPU time, once they have exited (Lightning shuts them down after fit).
    return wall / steps, cpu / steps, sum(DISPATCH) / steps, (_children_cpu() - before) / steps


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--items", type=int, default=480)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    timed_dispatch()
    hooks: dict[str, list[float]] = {}
    step_time("callback", args.items, args.workers, {})  # warm-up: imports, first compilations
    times: dict[str, list[tuple[float, float, float, float]]] = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        order = KINDS[r % 3 :] + KINDS[: r % 3]  # each kind first, second and third in turn
        for kind in order:
            times[kind].append(step_time(kind, args.items, args.workers, hooks))
    print(f"{args.items // 8} steps an epoch, {args.workers} workers, {args.rounds} rounds")
    for i, what in enumerate(("wall", "main-process CPU")):
        medians = {kind: statistics.median(t[i] for t in times[kind]) for kind in KINDS}
        print(f"{what}, ms a step: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in medians.items()))
        for base in ("plain", "deterministic"):
            ratios = [c[i] / b[i] for b, c in zip(times[base], times["callback"], strict=True)]
            print(
                f"  callback / {base}: median {statistics.median(ratios):.3f} "
                f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
            )
    per_step = sum(statistics.median(spent) for spent in hooks.values())  # once a step each
    base_step = statistics.median(t[0] for t in times["deterministic"])
    dispatch = {kind: statistics.median(t[2] for t in times[kind]) for kind in KINDS}
    lightning = dispatch["callback"] - dispatch["deterministic"] - per_step
    workers_cpu = {kind: statistics.median(t[3] for t in times[kind]) for kind in KINDS}
    print(
        "the workers' CPU, ms a step: "
        + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in workers_cpu.items())
    )
    for base in ("plain", "deterministic"):
        ratios = [
            (c[1] + c[3]) / (b[1] + b[3])
            for b, c in zip(times[base], times["callback"], strict=True)
        ]
        print(
            f"  all CPU (main + workers), callback / {base}: median "
            f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
        )
    print(
        f"the callback's hooks: {per_step * 1e6:.1f} us a step, "
        f"{per_step / base_step:.2%} of a step with deterministic=True"
    )
    print(
        f"Lightning's dispatch of the per-step hooks: {dispatch['deterministic'] * 1e6:.1f} us "
        f"a step without the callback, {dispatch['callback'] * 1e6:.1f} with it; "
        f"less the hooks, {lightning * 1e6:.1f} us ({lightning / base_step:.2%}) is Lightning's "
        f"dispatch to the callback; hooks + that: {(per_step + lightning) / base_step:.2%}"
    )


if __name__ == "__main__":
    main()
