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
#: Seconds of each dispatch of a PER_STEP event, by event, in the runs with (True) and
#: without (False) the callback.
DISPATCH: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
WITH = [False]  # whether the run in progress has the callback
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
            DISPATCH[WITH[0]].setdefault(event, []).append(time.perf_counter() - start)

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


def run(*, callback: bool, steps: int, workers: int) -> float:
    """The median step time of one training run, in ms."""
    timer = StepTimes()
    WITH[0] = callback
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
    return 1e3 * statistics.median(intervals)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    options = parser.parse_args()
    timed_dispatch()
    run(callback=True, steps=6, workers=options.workers)  # warm-up: imports, first workers
    EVENTS.clear()
    DISPATCH[True].clear()
    without: list[float] = []
    with_: list[float] = []
    for _ in range(options.repeats):
        without.append(run(callback=False, steps=options.steps, workers=options.workers))
        with_.append(run(callback=True, steps=options.steps, workers=options.workers))
    a, b = statistics.median(without), statistics.median(with_)
    print(f"transformers {transformers.__version__}, {options.workers} workers, ", end="")
    print(f"{options.steps} steps x {options.repeats} runs each, medians")
    print("| run | ms per step |")
    print("|---|---|")
    print(f"| without the callback | {a:.3f} |")
    print(f"| with TransformersCallback | {b:.3f} |")
    verdict = "met" if b <= 1.03 * a else "missed"
    print(f"ratio {b / a:.3f} (target <= 1.03: {verdict})")
    # Each once a step (one forward a step here); medians of single calls, in us.
    own = {name: 1e6 * statistics.median(spent) for name, spent in EVENTS.items()}
    print(
        "the callback's own code, us a step: " + ", ".join(f"{k} {v:.1f}" for k, v in own.items())
    )
    added = {
        event: 1e6 * (statistics.median(DISPATCH[True][event]) - statistics.median(spent))
        for event, spent in DISPATCH[False].items()
    }
    share = sum(added.values()) - own["on_step_begin"] - own["on_step_end"]
    total = sum(own.values()) + share
    print(
        "the Trainer's dispatch of each per-step event, us more with the callback: "
        + ", ".join(f"{k} {v:.1f}" for k, v in added.items())
        + f"; less the callback's events: {share:.1f} us"
    )
    print(f"the callback's code + that: {total:.1f} us a step, {total / (1e3 * a):.2%} of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
