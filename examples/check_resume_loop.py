"""A plain training loop that resumes mid-epoch, with the two lines ``check-resume`` needs.

    deterministic-ctx check-resume --at 6 --at 9 -- examples/check_resume_loop.py

trains a small model with dropout for 2 epochs of 6 steps on an augmented dataset
(``SeededDataset`` + ``SeededSampler``, two DataLoader worker processes) and saves a
checkpoint every 3 steps to ``checkpoint.pt`` in the working directory: the model, the
optimizer, the sampler's position and a ``Snapshot`` of every RNG.  Started where that file
exists, it resumes from it.  Run on its own it just trains; ``check-resume`` runs it
uninterrupted, kills it after the checkpoint of step ``K`` (6: an epoch's last batch; 9: the
middle of the second epoch) and starts it again, and compares the steps.

The two lines are ``record_step(...)`` after each step and ``checkpoint_saved(...)`` after
each checkpoint; outside ``check-resume`` they do nothing.

``CHECK_RESUME_EXAMPLE_BUG`` plants a bug for the tests and the docs:

* ``snapshot``: the checkpoint leaves the ``Snapshot`` out, so the resumed run's dropout
  draws other numbers: the data still match, the RNG state and the loss do not;
* ``skip``: the resumed loop starts at the epoch after the saved one, skipping the rest of
  it (after an epoch-end checkpoint: every remaining step).
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from deterministic_ctx import (
    SeededDataset,
    SeededSampler,
    Snapshot,
    checkpoint_saved,
    record_step,
    seed_everything,
    seeded_generator,
)

EPOCHS, BATCH, SIZE, EVERY = 2, 4, 24, 3
CHECKPOINT = "checkpoint.pt"  # relative: each run of check-resume has a directory of its own
BUG = os.environ.get("CHECK_RESUME_EXAMPLE_BUG", "")


class Points(Dataset):
    """Points of a line, augmented with noise from every global RNG."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.linspace(-1, 1, 8) * (i + 1) / SIZE
        x = x + 0.05 * torch.randn(8)  # torch's generator
        x = x * np.random.uniform(0.9, 1.1)  # NumPy's global RNG
        if random.random() < 0.5:  # Python's random
            x = x.flip(0)
        return x.float(), x.sum(dim=0, keepdim=True).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    args = parser.parse_args()

    seed_everything(0)
    dataset = SeededDataset(Points(), seed=0)
    sampler = SeededSampler(dataset, seed=0)
    loader = DataLoader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=args.workers,
        generator=seeded_generator(0, "train"),
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    step, start_epoch = 0, 0
    if os.path.exists(CHECKPOINT):
        ckpt = torch.load(CHECKPOINT, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        sampler.load_state_dict(ckpt["sampler"])
        step, start_epoch = ckpt["step"], ckpt["epoch"]
        if BUG == "skip":
            start_epoch += 1
        if "rng" in ckpt:
            Snapshot.from_state_dict(ckpt["rng"]).restore()  # last: dropout continues its stream

    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)  # the saved epoch keeps the loaded position
        for i, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            record_step(step, loss=loss, batch=(x, y))  # line 1 of 2
            if step % EVERY == 0:
                last = i + 1 == len(loader)
                ckpt = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    # The epoch to go on with: after its last batch, the next one.
                    "epoch": epoch + last,
                    # The workers have taken indices ahead of the loop: say what it used.
                    "sampler": sampler.state_dict(consumed=(i + 1) * BATCH),
                }
                if BUG != "snapshot":
                    ckpt["rng"] = Snapshot.capture().state_dict()
                torch.save(ckpt, CHECKPOINT + ".tmp")
                os.replace(CHECKPOINT + ".tmp", CHECKPOINT)  # never a half-written checkpoint
                checkpoint_saved(step)  # line 2 of 2
    print(f"trained {step} steps")


if __name__ == "__main__":
    main()
