"""Crash a transformers ``Trainer`` run with ``SIGKILL``, resume it in a fresh process: bit for bit.

    python examples/transformers_resume.py

trains a tiny model with dropout for 2 epochs of 6 steps on an augmented dataset (noise
from Python's ``random``, NumPy's global RNG and torch's), with
``callbacks=[TransformersCallback(seed=0)]`` and two DataLoader worker processes; then
trains again and is killed (``SIGKILL``, a real crash) right after the checkpoint of step
4 (the middle of the first epoch) is on disk, and once more right after the checkpoint of
step 6 (the first epoch's last step); each time a *fresh Python process* resumes with
``trainer.train(resume_from_checkpoint=...)``, once with no worker process at all.

It prints whether the losses of every step and the final weights of each resumed run are
identical, bit for bit, to the uninterrupted run's, and exits with status 1 if one is not.
``--without-callback`` runs the same without ``TransformersCallback``: the resumed losses
then differ.  Without transformers or accelerate installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from torch import nn

try:
    import accelerate  # noqa: F401  (the Trainer needs it)
    import transformers
except Exception as exc:  # not installed, or built for another torch
    transformers = None
    MISSING = f"{type(exc).__name__}: {exc}"

EPOCHS, BATCH, ITEMS = 2, 4, 24  # 6 steps per epoch


class Points(torch.utils.data.Dataset):
    """24 points of a line, augmented with noise from every global RNG."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.linspace(-1, 1, 8) * (i + 1) / ITEMS
        x = x + 0.05 * torch.randn(8)  # torch's generator
        x = x * float(np.random.uniform(0.9, 1.1))  # NumPy's global RNG
        if random.random() < 0.5:  # Python's random
            x = x.flip(0)
        return {"x": x.float(), "y": x.sum(dim=0, keepdim=True).float()}


class Tiny(nn.Module):
    """A linear model with dropout whose forward returns ``{"loss": ...}``, as the Trainer wants."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), y)}


def child(output_dir: str, *, workers: int, resume: bool, callback: bool, report: str) -> None:
    """One training run in this process; the steps' losses and final weights go to ``report``."""
    from transformers import Trainer, TrainingArguments

    from deterministic_ctx import checkpoint_saved

    transformers.set_seed(0)  # as transformers scripts do: the model's initial weights
    model = Tiny()
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=0.05,
        logging_steps=1,
        save_steps=2,
        dataloader_num_workers=workers,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    if callback:
        from deterministic_ctx import TransformersCallback

        callbacks: list[Any] = [TransformersCallback(seed=0)]
    else:

        class Crash(transformers.TrainerCallback):
            def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                checkpoint_saved(state.global_step)  # what TransformersCallback does

        callbacks = [Crash()]
    trainer = Trainer(model=model, args=args, train_dataset=Points(), callbacks=callbacks)
    last = None
    if resume:
        last = transformers.trainer_utils.get_last_checkpoint(output_dir)
    trainer.train(resume_from_checkpoint=last)
    losses = {
        str(h["step"]): float(h["loss"]).hex() for h in trainer.state.log_history if "loss" in h
    }
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(
            name.encode() + tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
        )
    with open(report, "w") as f:
        json.dump({"losses": losses, "weights": digest.hexdigest()}, f)


def run(
    workdir: str, *, workers: int, resume: bool = False, kill_at: int | None = None, callback: bool
) -> dict[str, Any] | None:
    """A fresh Python process runs :func:`child`; killed after checkpoint ``kill_at``: ``None``."""
    report = os.path.join(workdir, "report.json")
    env = dict(os.environ)
    env.pop("DETERMINISTIC_CTX_RESUME_KILL_AT", None)
    if kill_at is not None:  # the crash, as deterministic-ctx check-resume asks for it
        env["DETERMINISTIC_CTX_RESUME_RECORDS"] = os.path.join(workdir, "records.jsonl")
        env["DETERMINISTIC_CTX_RESUME_KILL_AT"] = str(kill_at)
    spec = {"output_dir": os.path.join(workdir, "out"), "workers": workers, "resume": resume}
    spec.update(callback=callback, report=report)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
    )
    if kill_at is not None:
        if proc.returncode != -9:
            sys.exit(
                f"the run to crash at step {kill_at} ended with {proc.returncode}:\n{proc.stderr}"
            )
        return None
    if proc.returncode != 0:
        sys.exit(f"a training run failed:\n{proc.stderr}")
    with open(report) as f:
        return dict(json.load(f))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--without-callback", action="store_true", help="leave the callback out")
    options = parser.parse_args()
    if transformers is None:
        print(f"transformers or accelerate does not import here ({MISSING}): nothing to show")
        return 0
    if options.child:
        child(**json.loads(options.child))
        return 0
    callback = not options.without_callback
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        whole = run(os.path.join(tmp, "whole"), workers=2, callback=callback)
        assert whole is not None
        print(f"uninterrupted run: {len(whole['losses'])} steps")
        for kill_at, where, workers in [
            (4, "mid-epoch", 2),
            (6, "at the epoch's end", 2),
            (4, "mid-epoch", 0),
        ]:
            workdir = os.path.join(tmp, f"crash-{kill_at}-{workers}")
            run(workdir, workers=2, kill_at=kill_at, callback=callback)
            resumed = run(workdir, workers=workers, resume=True, callback=callback)
            assert resumed is not None
            same_losses = resumed["losses"] == whole["losses"]
            same_weights = resumed["weights"] == whole["weights"]
            print(
                f"killed after the checkpoint of step {kill_at} ({where}), resumed with "
                f"{workers} workers: identical losses: {same_losses}, "
                f"identical weights: {same_weights}"
            )
            ok = ok and same_losses and same_weights
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
