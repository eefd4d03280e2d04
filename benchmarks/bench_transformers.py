"""What ``TransformersCallback`` costs per training step of a transformers ``Trainer``.

    python benchmarks/bench_transformers.py [--repeats 5] [--steps 60] [--workers 2]

Trains ``examples/transformers_resume.py``'s tiny model (a linear model with dropout, an
augmented dataset of 24 points, batches of 4) with and without
``callbacks=[TransformersCallback(seed=0)]``, the two alternating in one process.  A step's
time is the interval between two consecutive ``on_step_end`` events (data loading, the
forward and backward passes, the optimizer, every callback); each run gives the median of
its intervals, and the table shows the median over runs of each side and their ratio, with
the target of issue 41: the callback's cost at most 3% of a step.
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


def run(*, callback: bool, steps: int, workers: int) -> float:
    """The median step time of one training run, in ms."""
    timer = StepTimes()
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
        callbacks: list[Any] = [TransformersCallback(seed=0)] if callback else []
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
    run(callback=True, steps=6, workers=options.workers)  # warm-up: imports, first workers
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
