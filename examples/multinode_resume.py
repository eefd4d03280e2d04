"""Two nodes x two processes on loopback, checkpointed with DCP midway, resumed bit for bit.

Run:  python examples/multinode_resume.py

It starts two ``torchrun`` agents on this machine, as two nodes of two processes
each (c10d rendezvous on 127.0.0.1, gloo), twice:

1. an uninterrupted run of 4 epochs, which saves a ``torch.distributed.checkpoint``
   (model, optimizer and ``RngState()``: every rank's random state under its own
   key) after epoch 2;
2. fresh processes that load that checkpoint and train epochs 3 and 4.

It prints the losses after the checkpoint and whether the resumed run's final
parameters equal the uninterrupted run's, bit for bit, and exits with status 1 if
they do not.  ``--workdir DIR`` keeps the checkpoint and the agents' logs there
(default: a temporary directory, removed at the end).

What the training draws from, all of which must continue exactly where it was:

* DataLoader workers seeded by ``seed_worker`` (Python ``random``, NumPy and torch
  augmentation, different on every rank and worker), their base seed drawn from a
  registered per-rank generator;
* dropout, from torch's generator, reseeded per rank after the model is built
  (``torch.manual_seed(rank_seed(SEED))``) so masks differ across ranks: a state
  that only per-rank checkpoint keys bring back;
* ``DistributedSampler(seed=SEED)``, which shuffles per epoch.

Bit for bit also needs DDP's gradient buckets laid out as in the uninterrupted run:
DDP rebuilds them after its first backward, so the resumed run takes one throwaway
step before loading (see ``train``).

Each agent runs in a process session of its own, is stopped (with its workers)
if it outlives its time or this script, and a worker exits if its agent dies.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import deterministic_ctx
from deterministic_ctx import (
    RngState,
    rank_seed,
    register_rng,
    seed_everything,
    seed_worker,
    seeded_generator,
)

NODES = 2
PROCESSES_PER_NODE = 2
SEED = 0
EPOCHS = 4
SAVE_AFTER = 2  # epochs
#: Seconds one run (both agents, their workers) may take before it is stopped.
RUN_TIMEOUT = 240.0


class Synthetic(Dataset):
    """Noisy linear regression; ``__getitem__`` augments with all three global RNGs."""

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


class Training:
    """Model and optimizer as one DCP ``Stateful`` (the DCP tutorial's ``AppState``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )


# -- one rank (what torchrun starts) -------------------------------------------------------------


def exit_when_orphaned() -> None:
    """End this worker if its agent dies (torchrun starts workers in sessions of their own)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def train(phase: str, workdir: Path) -> None:
    exit_when_orphaned()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # from torchrun's env
    rank = dist.get_rank()
    checkpoint = workdir / "checkpoint"
    try:
        seed_everything(SEED, rank="auto")  # torch shared (same init), the rest per rank
        # Draws the base seed of each epoch's workers; registered, so RngState saves it.
        loader_rng = register_rng(seeded_generator(SEED, "loader", rank="auto"), key="loader")
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        ddp = DistributedDataParallel(model)
        torch.manual_seed(rank_seed(SEED))  # dropout masks per rank
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        dataset = Synthetic(seeded_generator(SEED, "data"))  # the same data on every rank
        sampler = DistributedSampler(dataset, seed=SEED)
        loader = DataLoader(
            dataset,
            batch_size=8,
            sampler=sampler,
            num_workers=2,  # started per epoch, seeded from that epoch's base seed
            worker_init_fn=seed_worker,
            generator=loader_rng,
        )
        state = {"training": Training(ddp, optimizer), "rng": RngState()}
        start = 0
        if phase == "resume":
            # DDP rebuilds its gradient buckets after its first backward, in the order the
            # gradients became ready; the all-reduce then sums each gradient in another
            # order (with other roundings).  The uninterrupted run rebuilt them long ago: do
            # the same with one throwaway step, whose effects the load overwrites.
            ddp(torch.zeros(1, 8)).sum().backward()
            optimizer.zero_grad()
            # dcp.load calls load_state_dict in the keys' order: RngState's, then
            # Training's (set_state_dict draws no random numbers).  Nothing draws between
            # here and the loop.
            dcp.load(state, checkpoint_id=checkpoint)
            start = SAVE_AFTER
        losses = []
        for epoch in range(start, EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = nn.functional.mse_loss(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            if phase == "full" and epoch + 1 == SAVE_AFTER:
                dcp.save(state, checkpoint_id=checkpoint)
        weights = b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters())
        result = {
            "rank": rank,
            "node": int(os.environ["GROUP_RANK"]),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "losses": [v.hex() for v in losses],
            "weights": hashlib.sha256(weights).hexdigest(),
        }
        (workdir / f"{phase}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback() -> str:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def _stop_with_parent() -> None:
    """In a child, before it runs: SIGTERM it when this script dies (Linux), so an agent
    never outlives the script, even if the script is killed."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(agents: list[subprocess.Popen[bytes]]) -> None:
    """Stop every agent still running: SIGTERM (an agent then stops its workers), then
    SIGKILL to its session after a grace period."""
    for agent in agents:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for agent in agents:
        try:
            agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


def run(phase: str, workdir: Path) -> float:
    """One run: two torchrun agents (two nodes) of two processes each; its duration."""
    port = free_port()
    # The workers import the deterministic_ctx this script imported.
    package_root = str(Path(deterministic_ctx.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": loopback(),
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={NODES}",
        f"--nproc-per-node={PROCESSES_PER_NODE}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={phase}-{port}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        __file__,
        "--worker",
        phase,
        "--workdir",
        str(workdir),
    ]
    start = time.monotonic()
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for node in range(NODES):
            with open(workdir / f"{phase}-agent{node}.log", "wb") as log:
                agents.append(
                    subprocess.Popen(
                        command,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # its own session: stopped as a whole
                        preexec_fn=_stop_with_parent,
                    )
                )
        deadline = start + RUN_TIMEOUT
        for agent in agents:
            try:
                agent.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise SystemExit(f"the {phase} run did not finish in {RUN_TIMEOUT:.0f} s") from None
    finally:
        _stop(agents)
    failed = [node for node, agent in enumerate(agents) if agent.returncode != 0]
    if failed:
        for node in failed:
            log = (workdir / f"{phase}-agent{node}.log").read_text(errors="replace")
            print(f"--- agent {node} ({phase}) ---\n{log[-4000:]}", file=sys.stderr)
        raise SystemExit(f"the {phase} run failed on node(s) {failed}")
    return time.monotonic() - start


def results(phase: str, workdir: Path) -> list[dict[str, Any]]:
    world = NODES * PROCESSES_PER_NODE
    return [json.loads((workdir / f"{phase}-rank{r}.json").read_text()) for r in range(world)]


def main(workdir: Path) -> int:
    seconds = run("full", workdir)
    print(
        f"uninterrupted: {NODES} nodes x {PROCESSES_PER_NODE} processes, {EPOCHS} epochs, "
        f"DCP checkpoint after epoch {SAVE_AFTER} ({seconds:.1f} s)"
    )
    seconds = run("resume", workdir)
    print(
        f"resumed in fresh processes from the checkpoint, epochs {SAVE_AFTER + 1}-{EPOCHS} "
        f"({seconds:.1f} s)"
    )
    full, resumed = results("full", workdir), results("resume", workdir)
    layout = ", ".join(f"rank {r['rank']}: node {r['node']} local {r['local_rank']}" for r in full)
    print(f"layout: {layout}")
    same_losses = True
    for a, b in zip(full, resumed, strict=True):
        identical = a["losses"][-len(b["losses"]) :] == b["losses"]
        same_losses &= identical
        shown = " ".join(f"{float.fromhex(v):.6f}" for v in b["losses"])
        print(f"rank {a['rank']} losses after the checkpoint: {shown} (identical: {identical})")
    per_rank = len({tuple(r["losses"]) for r in full}) == len(full)
    print(f"each rank drew its own batches and dropout: {per_rank}")
    weights = {r["weights"] for r in full + resumed}
    same = same_losses and len(weights) == 1
    print(f"final parameters {full[0]['weights'][:16]}..., resumed {resumed[0]['weights'][:16]}...")
    print(f"resumed final parameters equal the uninterrupted run's bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint and logs here")
    parser.add_argument("--worker", choices=("full", "resume"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        train(args.worker, args.workdir)
    elif args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        sys.exit(main(args.workdir.resolve()))
    else:
        with tempfile.TemporaryDirectory(prefix="multinode-resume-") as tmp:
            status = main(Path(tmp))
        sys.exit(status)
