"""Stop a training loop in the middle of an epoch and resume it in a fresh process, bit for bit.

    python examples/resume_mid_epoch.py

trains a small model with dropout for 2 epochs of 5 steps on an augmented dataset
(``SeededDataset`` + ``SeededSampler``, two DataLoader worker processes); then trains
again, stops at step 7 (in the middle of the second epoch) and saves a checkpoint; then a
*fresh Python process* loads it and trains the last 3 steps.  It does this twice:

* with torchdata's ``StatefulDataLoader``, whose ``state_dict()`` holds the sampler's;
* with a plain ``torch.utils.data.DataLoader``, telling the sampler how many samples the
  loop consumed (``sampler.state_dict(consumed=...)``), and resuming with another number
  of workers.

It prints whether the losses and final weights of each resumed run are identical, bit for
bit, to the uninterrupted run's, and exits with status 1 if one is not.  Without torchdata
installed, the first part is left out (said so on one line).

The augmentation draws from Python's ``random``, NumPy's global RNG and torch's; each
sample's draws are keyed by (seed, epoch, index), so the worker that loads it, the
workers' prefetching and the resume point play no part.
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

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from deterministic_ctx import (
    SeededDataset,
    SeededSampler,
    Snapshot,
    seed_everything,
    seeded_generator,
)

EPOCHS, BATCH, STOP_AT = 2, 4, 7
try:  # installed but built for another torch, it may fail to import
    from torchdata.stateful_dataloader import StatefulDataLoader
except Exception:
    StatefulDataLoader = None
HAS_TORCHDATA = StatefulDataLoader is not None


class Points(Dataset):
    """20 points of a line, augmented with noise from every global RNG."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.linspace(-1, 1, 8) * (i + 1) / 20
        x = x + 0.05 * torch.randn(8)  # torch's generator
        x = x * np.random.uniform(0.9, 1.1)  # NumPy's global RNG
        if random.random() < 0.5:  # Python's random
            x = x.flip(0)
        return x.float(), x.sum(dim=0, keepdim=True).float()


def train(
    kind: str, checkpoint: str, *, workers: int, stop_at: int | None = None, resume: bool = False
) -> tuple[list[float], nn.Module]:
    """Train for ``EPOCHS`` epochs; save at step ``stop_at`` and stop; or resume first."""
    seed_everything(0)
    dataset = SeededDataset(Points(), seed=0)
    sampler = SeededSampler(dataset, seed=0)
    Loader = StatefulDataLoader if kind == "stateful" else DataLoader
    # Its own generator: creating an iterator otherwise draws the workers' base seed from
    # torch's global stream, and a resumed run creates one iterator more than a whole one.
    loader = Loader(
        dataset,
        batch_size=BATCH,
        sampler=sampler,
        num_workers=workers,
        generator=seeded_generator(0, "train"),
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    step, start_epoch = 0, 0
    if resume:
        ckpt = torch.load(checkpoint, weights_only=True)  # no pickle code runs
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, start_epoch = ckpt["step"], ckpt["epoch"]
        if kind == "stateful":
            loader.load_state_dict(ckpt["loader"])  # the sampler's position comes with it
        else:
            sampler.load_state_dict(ckpt["sampler"])
        Snapshot.from_state_dict(ckpt["rng"]).restore()  # last: dropout continues its stream

    losses = []
    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)  # after a resume, the saved epoch: its position is kept
        for i, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step == stop_at:
                ckpt = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "epoch": epoch,
                    "rng": Snapshot.capture().state_dict(),
                }
                if kind == "stateful":
                    ckpt["loader"] = loader.state_dict()
                else:  # the workers have taken indices ahead of the loop: say what it used
                    ckpt["sampler"] = sampler.state_dict(consumed=(i + 1) * BATCH)
                torch.save(ckpt, checkpoint)
                return losses, model
    return losses, model


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def result(losses: list[float], model: nn.Module) -> dict[str, object]:
    return {"losses": [x.hex() for x in losses], "weights": weights_digest(model)}


#: (loader kind, workers before the stop, workers after the resume, what it is)
RUNS = [
    ("stateful", 2, 2, "StatefulDataLoader, 2 workers"),
    ("plain", 2, 1, "DataLoader + SeededSampler, 2 workers, then 1 after the resume"),
]


def demo() -> int:
    runs = [run for run in RUNS if run[0] != "stateful" or HAS_TORCHDATA]
    if not HAS_TORCHDATA:
        print("torchdata's StatefulDataLoader does not import here: that part is left out")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        before = {}
        for kind, workers, _after, _what in runs:
            whole = result(*train(kind, os.path.join(tmp, "unused"), workers=workers))
            first, _ = train(
                kind, os.path.join(tmp, f"{kind}.pt"), workers=workers, stop_at=STOP_AT
            )
            before[kind] = whole, first
        # The resumes, in one fresh Python process.
        argv = [a for kind, _w, after, _ in runs for a in ("--resume", kind, str(after))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--dir", tmp, *argv],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            timeout=300,
        )
        resumed = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind, _workers, _after, what in runs:
        whole, first = before[kind]
        second = resumed[kind]
        same_losses = [x.hex() for x in first] + second["losses"] == whole["losses"]
        same_weights = second["weights"] == whole["weights"]
        print(
            f"{what}: stopped at step {STOP_AT} of {len(whole['losses'])} (epoch 2), resumed in "
            f"a fresh process: identical losses: {same_losses}, identical weights: {same_weights}"
        )
        ok = ok and same_losses and same_weights
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="where the checkpoints are (with --resume)")
    parser.add_argument(
        "--resume", nargs=2, action="append", metavar=("KIND", "WORKERS"), default=[]
    )
    args = parser.parse_args()
    if not args.resume:
        return demo()
    out = {}
    for kind, workers in args.resume:
        path = os.path.join(args.dir, f"{kind}.pt")
        out[kind] = result(*train(kind, path, workers=int(workers), resume=True))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
