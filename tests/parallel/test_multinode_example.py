"""examples/multinode_resume.py: two torchrun agents as two nodes of two processes on
loopback, a DCP checkpoint midway, a resume in fresh processes, bit for bit."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.helpers import ROOT, needs_gloo, run_python

#: Seconds the whole example (two runs, each two agents and four workers) may take.
TIMEOUT = 600


def processes_mentioning(text: str) -> list[str]:
    """The command lines of running processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("multinode")
    proc = run_python(
        [str(ROOT / "examples" / "multinode_resume.py"), "--workdir", str(workdir)],
        timeout=TIMEOUT,
        own_session=True,  # on a timeout, the launcher and what it started are killed
    )
    return workdir, proc


@needs_gloo
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_resumed_run_ends_bit_for_bit_where_the_uninterrupted_one_does(example):
    workdir, proc = example
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "resumed final parameters equal the uninterrupted run's bit for bit: True" in out
    assert "each rank drew its own batches and dropout: True" in out
    # Two nodes of two processes: global ranks 0-3, node and local ranks from torchrun.
    assert (
        "layout: rank 0: node 0 local 0, rank 1: node 0 local 1, "
        "rank 2: node 1 local 0, rank 3: node 1 local 1"
    ) in out
    identical = re.findall(
        r"^rank (\d) losses after the checkpoint: .* \(identical: (\w+)\)$", out, re.M
    )
    assert identical == [(str(r), "True") for r in range(4)]
    # No agent, worker or DataLoader worker is left running.
    assert processes_mentioning(str(workdir)) == []


@needs_gloo
@pytest.mark.slow
def test_the_checkpoint_holds_each_ranks_random_state_as_tensors(example):
    workdir, proc = example
    assert proc.returncode == 0, proc.stderr
    entries = dcp.FileSystemReader(workdir / "checkpoint").read_metadata().state_dict_metadata
    rng = sorted(key for key in entries if key.startswith("rng."))
    assert rng == ["rng.meta", "rng.rank0", "rng.rank1", "rng.rank2", "rng.rank3"]
    assert all(isinstance(entries[key], TensorStorageMetadata) for key in rng)
