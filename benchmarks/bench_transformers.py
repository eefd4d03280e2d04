"""What ``TransformersCallback`` costs per training step of a transformers ``Trainer``.

    python benchmarks/bench_transformers.py [--repeats 5] [--steps 60] [--workers 2]

Trains ``examples/transformers_resume.py``'s tiny model (a linear model with dropout, an
augmented dataset of 24 points, batches of 4) with and without
``callbacks=[TransformersCallback(seed=0)]``, the two alternating in one process.  A step's
time is the interval between two consecutive ``on_step_end`` events (data loading, the
forward and backward passes, the optimizer, every callback); each run gives the median of
its intervals, and the table shows the median over runs of each side and their ratio, with
the target of issue 41: the callback's cost at most 3% of a step.

The callback's own cost is also timed directly: its per-step events (``on_step_begin``, which
reseeds the block around training, and ``on_step_end``) and its forward hooks, and the
Trainer's dispatch of the per-step events (``CallbackHandler.call_event``) with and without
it; the difference less the events is what the Trainer's dispatch spends on the callback.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import transformers
from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from deterministic_ctx import TransformersCallback, isolated

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "example", ROOT / "examples" / "transformers_resume.py"
)
assert _spec is not None
assert _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


class StepTimes(transformers.TrainerCallback):
    """The time of each ``on_step_end``."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter())


#: The events the Trainer sends every callback once an optimizer step (one batch each here).
PER_STEP = frozenset({"on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"})
DISPATCH: list[float] = []  # seconds in the Trainer's dispatch of PER_STEP, this run
EVENTS: dict[str, list[float]] = {}  # seconds in each of the callback's per-step events


def timed_dispatch() -> None:
    """Time the Trainer's dispatch of the per-step events into ``DISPATCH``."""
    call_event = CallbackHandler.call_event

    def wrapper(self: Any, event: str, *args: Any, **kwargs: Any) -> Any:
        if event not in PER_STEP:
            return call_event(self, event, *args, **kwargs)
        start = time.perf_counter()
        try:
            return call_event(self, event, *args, **kwargs)
        finally:
            DISPATCH.append(time.perf_counter() - start)

    CallbackHandler.call_event = wrapper  # type: ignore[method-assign]


def timed(callback: TransformersCallback) -> TransformersCallback:
    """``callback`` with its per-step events and forward hooks timed into ``EVENTS``."""
    for name in ("on_step_begin", "on_step_end", "_forward_starts", "_forward_ends"):
        hook = getattr(callback, name)
        times = EVENTS.setdefault(name, [])

        def wrapper(*args: Any, _hook: Any = hook, _spent: list[float] = times, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return _hook(*args, **kw)
            finally:
                _spent.append(time.perf_counter() - start)

        setattr(callback, name, wrapper)
    return callback


def run(*, callback: bool, steps: int, workers: int) -> tuple[float, float]:
    """The median step time of one training run and the seconds a step spent in the
    Trainer's dispatch of the per-step events, in ms."""
    timer = StepTimes()
    DISPATCH.clear()
    with tempfile.TemporaryDirectory() as tmp, isolated():
        transformers.set_seed(0)
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=example.BATCH,
            max_steps=steps,
            save_strategy="no",
            logging_strategy="no",
            dataloader_num_workers=workers,
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
        )
        callbacks: list[Any] = [timed(TransformersCallback(seed=0))] if callback else []
        trainer = Trainer(
            model=example.Tiny(),
            args=args,
            train_dataset=example.Points(),
            callbacks=[*callbacks, timer],
        )
        trainer.train()
    intervals = [b - a for a, b in zip(timer.times, timer.times[1:], strict=False)]
    return 1e3 * statistics.median(intervals), 1e3 * sum(DISPATCH) / len(timer.times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    options = parser.parse_args()
    timed_dispatch()
    run(callback=True, steps=6, workers=options.workers)  # warm-up: imports, first workers
    EVENTS.clear()
    without: list[tuple[float, float]] = []
    with_: list[tuple[float, float]] = []
    for _ in range(options.repeats):
        without.append(run(callback=False, steps=options.steps, workers=options.workers))
        with_.append(run(callback=True, steps=options.steps, workers=options.workers))
    a, b = (statistics.median(t[0] for t in runs) for runs in (without, with_))
    print(f"transformers {transformers.__version__}, {options.workers} workers, ", end="")
    print(f"{options.steps} steps x {options.repeats} runs each, medians")
    print("| run | ms per step |")
    print("|---|---|")
    print(f"| without the callback | {a:.3f} |")
    print(f"| with TransformersCallback | {b:.3f} |")
    verdict = "met" if b <= 1.03 * a else "missed"
    print(f"ratio {b / a:.3f} (target <= 1.03: {verdict})")
    # Once a step each (one forward a step here).
    events = 1e3 * sum(statistics.median(spent) for spent in EVENTS.values())
    dispatch = [statistics.median(t[1] for t in runs) for runs in (without, with_)]
    share = (
        dispatch[1]
        - dispatch[0]
        - 1e3 * sum(statistics.median(EVENTS[name]) for name in ("on_step_begin", "on_step_end"))
    )
    print(
        f"the callback's events and forward hooks: {events * 1e3:.1f} us a step "
        f"({events / a:.2%} of a step without it); the Trainer's dispatch of the per-step "
        f"events: {dispatch[0] * 1e3:.1f} us a step without the callback, "
        f"{dispatch[1] * 1e3:.1f} with it, {share * 1e3:.1f} us of that the dispatch's own"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
