"""Resume training from a checkpoint, bit for bit.

    python examples/resume_training.py

trains a small model for 20 steps in one go; then trains 10 steps, saves a
checkpoint (model, optimizer and the random state) and stops; then starts a
*fresh Python process* that loads the checkpoint and trains the last 10.  It
prints whether losses and final weights are identical, bit for bit, and exits
with status 1 if they are not.

The data pipeline draws from Python's ``random``, NumPy's global RNG, torch's
global RNG (and dropout does too) and from a registered user RNG, so resuming
only works if every one of them continues exactly where it was.

``train`` is the plain PyTorch loop of docs/how-to/checkpoints.md.
One phase alone: ``--steps 20 [--save-at 10] [--resume] --checkpoint PATH
[--rng-file]``; it prints one JSON line (losses as ``float.hex``, a SHA-256 of
the weights).
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

from deterministic_ctx import Snapshot, register_rng, seed_everything


def make_batch(augment: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch with augmentation: every global RNG and a user RNG are drawn from."""
    x = torch.randn(16, 8)
    x = x + torch.from_numpy(np.random.normal(0.0, 0.1, size=(16, 8)).astype(np.float32))
    if random.random() < 0.5:
        x = x.flip(0)
    x = x * augment.uniform(0.9, 1.1)
    y = x.sum(dim=1, keepdim=True)
    return x, y


def train(
    steps: int,
    checkpoint: str,
    *,
    save_at: int | None = None,
    resume: bool = False,
    rng_file: bool = False,
) -> tuple[list[float], nn.Module]:
    """Train for ``steps`` steps; save at ``save_at`` and stop; or resume first."""
    augment = register_rng(random.Random(), key="augment")  # before loading: found by key
    seed_everything(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    start = 0
    if resume:
        ckpt = torch.load(checkpoint, weights_only=True)  # no pickle code runs
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start = ckpt["step"]
        rng = (
            Snapshot.load(checkpoint + ".rng")
            if rng_file
            else Snapshot.from_state_dict(ckpt["rng"])
        )
        rng.restore()  # last: nothing may draw from an RNG between this and the loop

    losses = []
    for step in range(start, steps):
        x, y = make_batch(augment)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

        if step + 1 == save_at:
            rng = Snapshot.capture()  # at the same moment as the model and optimizer
            ckpt = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step + 1,
            }
            if rng_file:
                rng.save(checkpoint + ".rng")  # atomic, and loads without unpickling
            else:
                ckpt["rng"] = rng.state_dict()
            torch.save(ckpt, checkpoint)
            break
    return losses, model


def weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_phase(argv: list[str]) -> dict[str, object]:
    """Run one phase in a fresh Python process and return its JSON line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    )
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def demo() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = os.path.join(tmp, "ckpt.pt")
        whole = run_phase(["--steps", "20", "--checkpoint", checkpoint])
        first = run_phase(["--steps", "20", "--save-at", "10", "--checkpoint", checkpoint])
        second = run_phase(["--steps", "20", "--resume", "--checkpoint", checkpoint])
    resumed = list(first["losses"]) + list(second["losses"])  # type: ignore[call-overload]
    same_losses = resumed == whole["losses"]
    same_weights = second["weights"] == whole["weights"]
    print(f"losses of the resumed run identical to the uninterrupted run: {same_losses}")
    print(f"final weights identical: {same_weights}")
    return 0 if same_losses and same_weights else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int)
    parser.add_argument("--checkpoint")
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument(
        "--rng-file", action="store_true", help="save the RNG state with Snapshot.save"
    )
    args = parser.parse_args()
    if args.steps is None:
        return demo()
    losses, model = train(
        args.steps,
        args.checkpoint,
        save_at=args.save_at,
        resume=args.resume,
        rng_file=args.rng_file,
    )
    print(json.dumps({"losses": [x.hex() for x in losses], "weights": weights_digest(model)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
