"""Reproducible DDP training: 2 CPU processes on gloo, DataLoader workers, per-rank augmentation.

Run:  python examples/ddp_training.py                 # seed 0
      python examples/ddp_training.py --seed 7
      python examples/ddp_training.py --seed random   # drawn on rank 0, shared, printed
      python examples/ddp_training.py --runs 2        # train twice, in fresh processes

Two runs with the same seed print the same per-rank losses.  A run with
``--seed random`` prints the seed it drew: pass it back with ``--seed`` to replay.
``--runs N`` trains N times in a row, each time on freshly started ranks and
workers, and prints each run's output (with ``--seed random``, each draws its own).

What the example shows:

* one ``deterministic(seed=..., rank="auto")`` block per rank: torch (model
  initialization, dropout) is seeded alike on every rank, Python ``random``
  and NumPy per rank;
* ``DataLoader(worker_init_fn=seed_worker, generator=seeded_generator(det))``:
  every worker of every rank draws its own augmentation stream, the same on
  every run;
* ``DistributedSampler(seed=det.seed)``: the same shuffle on every rank (it
  must agree, since it splits one permutation), a new one each epoch;
* the synthetic dataset is built from ``seeded_generator(det.seed, "data")``,
  the same on every rank.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from deterministic_ctx import broadcast_seed, deterministic, seed_worker, seeded_generator

WORLD_SIZE = 2
EPOCHS = 2


class Synthetic(Dataset):
    """Noisy linear regression; ``__getitem__`` augments with all three RNGs."""

    def __init__(self, generator: torch.Generator, n: int = 64) -> None:
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(8)  # torch
        x = x * random.uniform(0.9, 1.1)  # Python's random
        y = self.y[i] + float(np.random.normal(0.0, 0.05))  # NumPy
        return x, y


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback() -> str:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def train(rank: int, port: int, seed: int | None) -> None:
    # Loopback only: the store listens on 127.0.0.1, gloo's own links on "lo".
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback())
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        # Rank 0's seed (drawn there for --seed random) on every rank.
        shared = broadcast_seed(seed)
        with deterministic(seed=shared, rank="auto") as det:
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16),
                torch.nn.ReLU(),
                torch.nn.Dropout(0.1),
                torch.nn.Linear(16, 1),
            )
            # Before DDP broadcasts rank 0's weights: were they equal anyway?
            init = torch.cat([p.detach().flatten() for p in model.parameters()])
            inits: list[torch.Tensor | None] = [None] * WORLD_SIZE
            dist.all_gather_object(inits, init)
            same_init = all(torch.equal(init, other) for other in inits)  # type: ignore[arg-type]

            ddp = DistributedDataParallel(model)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
            dataset = Synthetic(seeded_generator(det.seed, "data"))
            sampler = DistributedSampler(dataset, seed=det.seed)
            loader = DataLoader(
                dataset,
                batch_size=8,
                sampler=sampler,
                num_workers=2,
                persistent_workers=True,  # started once: under mp.spawn they are spawned too
                worker_init_fn=seed_worker,
                generator=seeded_generator(det),
            )
            losses = []
            for epoch in range(EPOCHS):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    loss = torch.nn.functional.mse_loss(ddp(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    losses.append(loss.item())

        everyone: list[list[float] | None] = [None] * WORLD_SIZE
        dist.all_gather_object(everyone, losses)
        if rank == 0:
            print(f"seed {shared}, world size {WORLD_SIZE}")
            print(f"model initialization identical on all ranks: {same_init}")
            for r, rank_losses in enumerate(everyone):
                assert rank_losses is not None
                print(f"rank {r} losses: " + " ".join(f"{v:.8f}" for v in rank_losses))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", default="0", help="an int, or 'random' to draw one")
    parser.add_argument("--runs", type=int, default=1, help="train this many times, from scratch")
    args = parser.parse_args()
    seed = None if args.seed == "random" else int(args.seed)
    for _ in range(args.runs):
        mp.spawn(train, args=(free_port(), seed), nprocs=WORLD_SIZE)


if __name__ == "__main__":
    main()
