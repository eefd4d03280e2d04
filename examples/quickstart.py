"""Quick start: a seeded training loop gives identical losses twice, and the
caller's random streams are untouched by it.

Run:  python examples/quickstart.py
"""

from __future__ import annotations

import random

import numpy as np
import torch

from deterministic_ctx import deterministic


def train(steps: int = 5) -> list[float]:
    """A tiny regression model trained on noisy synthetic data with dropout."""
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 8)
        noise = torch.from_numpy(np.random.normal(0, 0.1, size=(32, 1))).float()
        y = x.sum(dim=1, keepdim=True) + noise
        if random.random() < 0.5:  # Python's RNG decides an augmentation
            x = x.flip(0)
            y = y.flip(0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    torch.manual_seed(1234)  # the caller's own stream
    before = torch.get_rng_state()

    with deterministic(seed=0):
        first = train()
    with deterministic(seed=0):
        second = train()

    print("run 1 losses:", [f"{v:.6f}" for v in first])
    print("run 2 losses:", [f"{v:.6f}" for v in second])
    assert first == second, "the two seeded runs differ"
    print("identical losses: True")

    untouched = torch.equal(torch.get_rng_state(), before)
    assert untouched, "the caller's RNG state changed"
    print("caller's torch RNG untouched: True")


if __name__ == "__main__":
    main()
