"""accelerate's ``register_for_checkpointing`` with ``SeededSampler`` and ``RngState``: a fresh
``Accelerator``'s ``load_state`` puts back the sampler's position and the random state that
``save_state`` saw (docs/how-to/resume-mid-epoch.md).  Real accelerate, on the CPU."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from deterministic_ctx import (
    RngState,
    SeededDataset,
    SeededSampler,
    Snapshot,
    _torch,
    deterministic,
    register_rng,
    unregister_rng,
)

try:  # installed but built for another torch (the lowest corner), it may fail to import
    from accelerate import Accelerator
except Exception as exc:  # any failure means: not usable here
    Accelerator = None
    WHY = f"needs accelerate (pip install -e '.[test]'): {exc!r:.200}"
else:
    WHY = ""
pytestmark = pytest.mark.skipif(Accelerator is None, reason=WHY)
# torch 2.1 has no DCP Stateful protocol: RngState refuses there (tests/sources/test_torch_compat.py).
needs_rng_state = pytest.mark.skipif(
    not _torch.DCP_STATEFUL.available,
    reason=f"RngState needs {_torch.DCP_STATEFUL.reads} (torch >= {_torch.DCP_STATEFUL.since})",
)

N, BATCH, EPOCHS = 12, 2, 2


def _draws(rng: random.Random) -> tuple[float, ...]:
    """One draw of every stream the random state covers: the main process's and a registered one."""
    return (random.random(), float(np.random.rand()), torch.rand(()).item(), rng.random())


def _run(
    folder: Path, *, stop_at: int | None = None, resume: bool = False, register: bool = True
) -> list[tuple[object, ...]]:
    """Every step's batch and draws for ``EPOCHS`` epochs; with ``stop_at``, ``save_state``
    there and stop; with ``resume``, ``load_state`` first, in a fresh Accelerator."""
    records: list[tuple[object, ...]] = []
    user = random.Random(7)
    register_rng(user, key="test_accelerate")
    try:
        with deterministic(seed=0):  # also puts back what load_state restores
            accelerator = Accelerator(cpu=True)
            data = SeededDataset(list(range(N)), seed=0)
            sampler = SeededSampler(data, seed=0)
            loader = DataLoader(
                data, batch_size=BATCH, sampler=sampler, generator=torch.Generator()
            )
            accelerator.register_for_checkpointing(sampler, *([RngState()] if register else []))
            if resume:
                accelerator.load_state(str(folder))
            start = sampler.state_dict()["epoch"] if resume else 0
            for epoch in range(start, EPOCHS):
                sampler.set_epoch(epoch)
                for batch in loader:
                    records.append((epoch, batch.tolist(), *_draws(user)))
                    if len(records) == stop_at:
                        accelerator.save_state(str(folder))
                        return records
        return records
    finally:
        unregister_rng(user)


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[object, ...]]:
    return _run(tmp_path_factory.mktemp("whole"))


@needs_rng_state
@pytest.mark.parametrize("stop_at", [3, 6, 9])  # mid-epoch, the first epoch's last batch, later
def test_save_state_and_load_state_round_trip_the_sampler_and_the_random_state(
    whole, tmp_path, stop_at
):
    first = _run(tmp_path, stop_at=stop_at)
    rest = _run(tmp_path, resume=True)
    assert first + rest == whole
    assert len(whole) == EPOCHS * N // BATCH


@needs_rng_state
def test_what_is_saved_loads_without_unpickling(tmp_path):
    _run(tmp_path, stop_at=3)
    for path in sorted(tmp_path.glob("custom_checkpoint_*.pkl")):
        torch.load(path, weights_only=True)  # raises on anything but tensors and plain data


@needs_rng_state
def test_without_rng_state_a_registered_rng_is_not_resumed(whole, tmp_path):
    # The control: accelerate saves Python's, NumPy's and torch's streams, not registered RNGs.
    first = _run(tmp_path, stop_at=3, register=False)
    rest = _run(tmp_path, resume=True, register=False)
    assert [r[:5] for r in first + rest] == [r[:5] for r in whole]
    assert first + rest != whole


def test_a_snapshot_cannot_be_registered_rng_state_is_the_live_one():
    # A Snapshot is a capture frozen at its creation: saving it at every save_state would
    # store that old moment.  accelerate refuses it for lack of load_state_dict.
    with deterministic(seed=0):
        accelerator = Accelerator(cpu=True)
        with pytest.raises(ValueError, match=r"(?s)load_state_dict.*Snapshot"):
            accelerator.register_for_checkpointing(Snapshot.capture())
