"""Lightning training killed with SIGKILL and resumed bit for bit, with LightningCallback.

A plain Lightning script (``L.seed_everything(0)``, a Dataset that augments with
``random``, NumPy and torch, ``DataLoader(shuffle=True, num_workers=...)``,
dropout, ``ModelCheckpoint(every_n_train_steps=4, save_last=True)``) plus one
line: ``callbacks=[LightningCallback(seed=0), ...]``.

The example trains once uninterrupted, then twice more in fresh processes that
are killed with ``SIGKILL`` right after a checkpoint is on disk: mid-epoch
(step 8 of 18) and on an epoch's last batch (step 12), and restarted with
``fit(ckpt_path="last")`` in fresh processes, with another ``num_workers``.
It prints whether every step's loss and batch, and the final weights, match
the uninterrupted run, and exits 1 if not.

The kill uses ``deterministic-ctx check-resume``'s machinery (the callback calls
``checkpoint_saved``), so ``python -m deterministic_ctx check-resume --at 8 --at 12 --
examples/lightning_resume.py --train . --resume auto`` runs the same proof.

Run: ``python examples/lightning_resume.py``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from deterministic_ctx import LightningCallback

ITEMS, BATCH, EPOCHS, EVERY = 48, 8, 3, 4  # 6 batches an epoch, 18 steps


class Noisy(Dataset):
    """Items augmented with Python's, NumPy's and torch's global RNGs."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.full((4,), float(i)) / ITEMS
        x = x + torch.randn(4) * 0.1 + np.random.uniform(-0.1, 0.1) + random.gauss(0, 0.1)
        return x.float(), torch.tensor([float(i % 3)])


class Model(L.LightningModule):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.workers = workers

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        torch.rand(3)  # draws outside training steps do not shift training

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(Noisy(), batch_size=BATCH, shuffle=True, num_workers=self.workers)

    def val_dataloader(self):
        return DataLoader(Noisy(), batch_size=16)


def train(directory: Path, workers: int, resume: str | None) -> None:
    """One training run in ``directory`` (its checkpoints, and its final weights), resumed
    from ``directory / resume`` (``"auto"``: from last.ckpt if there is one)."""
    if resume == "auto":
        resume = "last.ckpt" if (directory / "last.ckpt").exists() else None
    L.seed_everything(0, verbose=False)
    model = Model(workers)
    trainer = L.Trainer(
        max_epochs=EPOCHS,
        callbacks=[
            LightningCallback(seed=0),
            ModelCheckpoint(
                dirpath=directory, every_n_train_steps=EVERY, save_top_k=-1, save_last=True
            ),
        ],
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model, ckpt_path=None if resume is None else str(directory / resume))
    torch.save(model.state_dict(), directory / "weights.pt")


def launch(directory: Path, workers: int, *, resume: str | None = None, kill_at: int | None = None):
    """Train in a fresh process (resumed from ``directory / resume``); returns its exit status."""
    env = dict(os.environ, DETERMINISTIC_CTX_RESUME_RECORDS=str(directory / "records.jsonl"))
    env.pop("DETERMINISTIC_CTX_RESUME_KILL_AT", None)
    if kill_at is not None:
        env["DETERMINISTIC_CTX_RESUME_KILL_AT"] = str(kill_at)
    command = [sys.executable, __file__, "--train", str(directory), "--workers", str(workers)]
    proc = subprocess.run(
        [*command, *(["--resume", resume] if resume else [])], env=env, check=False
    )
    return proc.returncode


def steps(directory: Path) -> dict[int, dict]:
    """Each step's record (its last one: a resumed run redoes steps after its checkpoint)."""
    records = [json.loads(line) for line in (directory / "records.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "step" in r}


def same(reference: Path, other: Path) -> list[str]:
    """What differs between two runs: steps (loss, batch, RNG) and final weights."""
    a, b = steps(reference), steps(other)
    problems = [f"steps {sorted(a)} vs {sorted(b)}"] if sorted(a) != sorted(b) else []
    problems += [f"step {s}: {a[s]} vs {b[s]}" for s in sorted(a) if s in b and a[s] != b[s]]
    wa, wb = (torch.load(d / "weights.pt") for d in (reference, other))
    problems += [f"weights {k} differ" for k in wa if not torch.equal(wa[k], wb[k])]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", type=Path, help="train once in this directory (a child)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--resume", help="the checkpoint to resume from, in the directory; auto")
    args = parser.parse_args()
    if args.train is not None:
        train(args.train, args.workers, args.resume)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        reference = root / "uninterrupted"
        reference.mkdir()
        launch(reference, workers=2)
        ok = True
        for kill_at, before, after, where in ((8, 2, 2, "mid-epoch"), (12, 0, 2, "epoch end")):
            run = root / f"killed-at-{kill_at}"
            run.mkdir()
            status = launch(run, workers=before, kill_at=kill_at)
            killed = status == -signal.SIGKILL
            launch(run, workers=after, resume="last.ckpt")
            problems = same(reference, run)
            ok &= killed and not problems
            print(
                f"killed at step {kill_at} ({where}, workers {before} -> {after}): "
                f"{'killed' if killed else f'NOT killed (exit {status})'}, "
                f"resumed {'bit for bit' if not problems else 'DIFFERENTLY: ' + problems[0]}"
            )
    print("all resumed runs match the uninterrupted one" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
