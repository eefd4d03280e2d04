"""RngState: every rank's random state in real torch.distributed.checkpoint save/load.

Checkpoints are written by spawned gloo ranks on 127.0.0.1 and resumed in freshly
spawned ones (:func:`tests.state.test_sync.launch`); single-process cases run here.
"""

from __future__ import annotations

import os
import pickle
import random
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from deterministic_ctx import _torch

# torch 2.1 has no Stateful protocol: RngState refuses there (tests/sources/test_torch_compat.py).
if not _torch.DCP_STATEFUL.available:
    pytest.skip(
        f"needs {_torch.DCP_STATEFUL.reads} (torch >= {_torch.DCP_STATEFUL.since}); "
        f"torch {torch.__version__} lacks it",
        allow_module_level=True,
    )

import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from deterministic_ctx import (
    InvalidSnapshotError,
    Snapshot,
    UnregisteredRngError,
    register_rng,
    unregister_rng,
)
from deterministic_ctx.state.dcp import CAPACITY, RngState
from deterministic_ctx.state.sync import RngStateError
from tests.helpers import needs_gloo
from tests.state.test_sync import _expect_error, draws, fingerprint, launch, needs_cuda

#: DCP warns that it saves and loads in one process when there is no process group.
one_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def augment():
    """A registered user RNG, unregistered after the test."""
    rng = register_rng(random.Random(1), key="augment")
    yield rng
    unregister_rng(rng)


# -- one process, no process group ------------------------------------------------------------


@one_process
def test_save_then_load_in_one_process_continues_every_stream(tmp_path, augment, restore_world):
    dcp.save({"rng": RngState()}, checkpoint_id=tmp_path)
    first = [random.random(), float(np.random.rand()), torch.rand(()).item(), augment.random()]
    dcp.load({"rng": RngState()}, checkpoint_id=tmp_path)
    again = [random.random(), float(np.random.rand()), torch.rand(()).item(), augment.random()]
    assert again == first


@one_process
def test_loading_leaves_this_processs_setup_alone(tmp_path, restore_world, monkeypatch):
    # Flags, managed environment variables (the NCCL recipe set before init_process_group)
    # and torch's defaults are the resumed run's own: only random state is loaded.
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    dcp.save({"rng": RngState()}, checkpoint_id=tmp_path)
    first = random.random()
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    benchmark = torch.backends.cudnn.benchmark
    dcp.load({"rng": RngState()}, checkpoint_id=tmp_path)
    assert random.random() == first
    assert torch.backends.cudnn.benchmark == benchmark
    assert os.environ["NCCL_ALGO"] == "Ring"


@one_process
def test_the_checkpoint_holds_tensors_only_under_per_rank_keys(tmp_path):
    dcp.save({"rng": RngState()}, checkpoint_id=tmp_path)
    metadata = dcp.FileSystemReader(tmp_path).read_metadata()
    entries = metadata.state_dict_metadata
    assert sorted(entries) == ["rng.meta", "rng.rank0"]
    # Nothing DCP would write with torch.save and read back with weights_only=False.
    assert all(isinstance(md, TensorStorageMetadata) for md in entries.values())
    assert entries["rng.rank0"].size == torch.Size([CAPACITY])
    assert entries["rng.rank0"].properties.dtype == torch.uint8


def test_it_is_a_stateful_whose_state_dict_torch_load_takes_with_weights_only(
    tmp_path, restore_world
):
    rng = RngState()
    assert isinstance(rng, Stateful)
    torch.save(rng.state_dict(), tmp_path / "rng.pt")
    first = random.random()
    rng.load_state_dict(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert random.random() == first


@one_process
def test_a_registered_rng_missing_here_is_an_error_and_changes_nothing(tmp_path, augment):
    dcp.save({"rng": RngState()}, checkpoint_id=tmp_path)
    unregister_rng(augment)
    try:
        before = fingerprint()
        with pytest.raises(UnregisteredRngError, match=r"RngState entry 'rank0'.*'augment'"):
            dcp.load({"rng": RngState()}, checkpoint_id=tmp_path)
        assert fingerprint() == before
    finally:
        register_rng(augment, key="augment")


def test_a_state_larger_than_the_capacity_is_refused_when_saving():
    with pytest.raises(
        ValueError, match=r"takes \d+ bytes, more than an RngState entry of capacity=4096"
    ):
        RngState(capacity=4096).state_dict()


@one_process
def test_loading_with_another_capacity_is_refused_by_dcp(tmp_path):
    dcp.save({"rng": RngState()}, checkpoint_id=tmp_path)
    before = fingerprint()
    with pytest.raises(BaseException, match="Size mismatch"):
        dcp.load({"rng": RngState(capacity=2 * CAPACITY)}, checkpoint_id=tmp_path)
    assert fingerprint() == before


def _flip(state: dict[str, Any], key: str, offset: int, mask: int = 0x01) -> dict[str, Any]:
    changed = {k: v.clone() for k, v in state.items()}
    changed[key][offset] ^= mask
    return changed


@settings(max_examples=60, deadline=None)
@given(offset=st.integers(0, CAPACITY - 1), mask=st.integers(1, 255))
def test_any_changed_byte_of_an_entry_is_caught_and_nothing_is_restored(offset, mask):
    rng = RngState()
    snap = Snapshot.capture()
    try:
        saved = rng.state_dict()
        random.random()  # move on: a restore would show
        before = fingerprint()
        with pytest.raises(InvalidSnapshotError, match=r"RngState entry 'rank0'"):
            rng.load_state_dict(_flip(saved, "rank0", offset, mask))
        assert fingerprint() == before
    finally:
        snap.restore()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (8, 2, r"format version 2 is newer than this deterministic-ctx reads \(1\)"),
        (12, 1, r"it holds the state of rank 1, not this rank's \(0\)"),
        (16, 2, r"it was saved in a world of 2 ranks, the checkpoint's is 1"),
        (20, 1, r"unknown format version 1.1"),
        (24, CAPACITY, r"its header declares \d+ bytes, more than the entry holds"),
    ],
)
def test_each_header_field_is_checked(field, value, message):
    saved = RngState().state_dict()
    struct.pack_into("<I", saved["rank0"].numpy(), field, value)
    with pytest.raises(InvalidSnapshotError, match=message):
        RngState().load_state_dict(saved)


@pytest.mark.parametrize(
    ("index", "value", "error", "message"),
    [
        (0, 1, InvalidSnapshotError, r"'meta'\): it is not an RngState entry"),
        (1, 2, InvalidSnapshotError, r"'meta'\): format version 2 is newer"),
        (3, 1, InvalidSnapshotError, r"'meta'\): unknown format version 1.1"),
        (2, 0, InvalidSnapshotError, r"'meta'\): world size 0 is out of range"),
        (2, 3, ValueError, r"holds the random state of 3 ranks, and this run has 1"),
    ],
)
def test_the_replicated_entry_is_checked(index, value, error, message):
    saved = RngState().state_dict()
    saved["meta"][index] = value
    before = fingerprint()
    with pytest.raises(error, match=message):
        RngState().load_state_dict(saved)
    assert fingerprint() == before


def test_entries_of_the_wrong_kind_are_refused():
    saved = RngState().state_dict()
    with pytest.raises(InvalidSnapshotError, match=r"there is no such entry"):
        RngState().load_state_dict({"meta": saved["meta"]})
    with pytest.raises(
        InvalidSnapshotError, match=r"expected a 1-D uint8 tensor, got a torch.int8"
    ):
        RngState().load_state_dict({**saved, "rank0": saved["rank0"].view(torch.int8)})
    with pytest.raises(InvalidSnapshotError, match=r"expected an int64 tensor of shape \[4\]"):
        RngState().load_state_dict({**saved, "meta": saved["meta"][:3]})
    with pytest.raises(TypeError, match=r"state_dict must be a dict, got list"):
        RngState().load_state_dict([])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"on_world_size_change": "reseed"},
            ValueError,
            r"must be 'error' or 'keep', got 'reseed'",
        ),
        ({"on_world_size_change": None}, TypeError, r"must be 'error' or 'keep', got NoneType"),
        ({"capacity": 1.5}, TypeError, r"capacity must be an int \(bytes\), got float 1.5"),
        ({"capacity": True}, TypeError, r"got bool True"),
        ({"capacity": 100}, ValueError, r"capacity must be in \[4096, \d+\] bytes, got 100"),
        ({"strict_devices": 1}, TypeError, r"strict_devices must be True or False, got 1"),
    ],
)
def test_bad_arguments_are_rejected_where_they_are_written(kwargs, error, message):
    with pytest.raises(error, match=message):
        RngState(**kwargs)


def test_it_shows_its_options():
    rng = RngState(on_world_size_change="keep", capacity=np.int64(1 << 20), strict_devices=True)
    assert (
        repr(rng) == "RngState(on_world_size_change='keep', capacity=1048576, strict_devices=True)"
    )
    assert (rng.on_world_size_change, rng.capacity, rng.strict_devices) == ("keep", 1 << 20, True)
    assert type(rng.capacity) is int


# -- real process groups ----------------------------------------------------------------------


def _registered(rank: int) -> tuple[random.Random, torch.Generator]:
    augment = register_rng(random.Random(100 + rank), key="augment")
    gen = register_rng(torch.Generator().manual_seed(200 + rank), key="gen")
    return augment, gen


def _scenario_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """Train-like per-rank state, a DCP checkpoint with a model, then what comes next."""
    from deterministic_ctx import seed_everything

    seed_everything(7, rank="auto")
    augment, gen = _registered(rank)
    model = torch.nn.Linear(3, 2)
    for _ in range(rank + 1):  # rank-local draws
        draws(augment, gen)
    dcp.save({"model": model.state_dict(), "rng": RngState()}, checkpoint_id=path)
    return {
        "next": [draws(augment, gen) for _ in range(3)],
        "weight": model.weight.detach().clone(),
    }


def _scenario_resume(rank: int, world: int, path: str, crafted: str) -> dict[str, Any]:
    """In fresh processes: load the checkpoint, then what comes next; then two bad loads."""
    from deterministic_ctx import seed_everything

    seed_everything(99)  # another state entirely
    augment, gen = _registered(rank + 10)
    model = torch.nn.Linear(3, 2)
    dcp.load({"model": model.state_dict(), "rng": RngState()}, checkpoint_id=path)
    result: dict[str, Any] = {
        "next": [draws(augment, gen) for _ in range(3)],
        "weight": model.weight.detach().clone(),
    }
    result["corrupted"] = _expect_error(
        lambda: dcp.load({"rng": RngState()}, checkpoint_id=crafted)
    )
    if rank == 0:
        unregister_rng(augment)
    result["missing"] = _expect_error(lambda: dcp.load({"rng": RngState()}, checkpoint_id=path))
    return result


def _scenario_grow(rank: int, world: int, path: str) -> dict[str, Any]:
    """A checkpoint of 2 ranks, loaded by 3."""
    _registered(rank)
    result: dict[str, Any] = {}
    before = fingerprint()
    try:
        dcp.load({"rng": RngState()}, checkpoint_id=path)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        result["plain"] = (type(exc).__name__, str(exc))
    partial = DefaultLoadPlanner(allow_partial_load=True)
    result["policy"] = _expect_error(
        lambda: dcp.load({"rng": RngState()}, checkpoint_id=path, planner=partial)
    )
    dcp.load(
        {"rng": RngState(on_world_size_change="keep")},
        checkpoint_id=path,
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    result["kept"] = fingerprint() == before
    return result


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A checkpoint written by 2 ranks, and what each rank drew after saving it."""
    root = tmp_path_factory.mktemp("dcp")
    path = root / "checkpoint"
    ranks = launch(f"{__name__}:_scenario_save", 2, root, str(path))
    return path, ranks


def _corrupt_rank_one(path: Path, crafted: Path) -> None:
    """A copy of a 2-rank checkpoint's RngState entries with one byte of rank 1's changed."""
    entries = {
        "meta": torch.zeros(4, dtype=torch.int64),
        "rank0": torch.zeros(CAPACITY, dtype=torch.uint8),
        "rank1": torch.zeros(CAPACITY, dtype=torch.uint8),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one process
        dcp.load({"rng": entries}, checkpoint_id=path)
        entries["rank1"][1000] ^= 0x20  # inside the snapshot: its checksum catches it
        dcp.save({"rng": entries}, checkpoint_id=crafted)


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    path, _ = saved
    root = tmp_path_factory.mktemp("dcp-resume")
    crafted = root / "crafted"
    _corrupt_rank_one(path, crafted)
    return launch(f"{__name__}:_scenario_resume", 2, root, str(path), str(crafted))


@needs_gloo
@pytest.mark.slow
def test_resumed_ranks_continue_bit_for_bit_each_from_its_own_state(saved, resumed):
    _, before = saved
    for rank in (0, 1):
        assert resumed[rank]["next"] == before[rank]["next"]
        assert torch.equal(resumed[rank]["weight"], before[rank]["weight"])
    # Each rank got its own state back, not one rank's copy (DCP's replicated-key trap).
    assert resumed[0]["next"] != resumed[1]["next"]


@needs_gloo
@pytest.mark.slow
def test_a_corrupted_entry_of_one_rank_makes_every_rank_raise_and_none_restore(resumed):
    for rank, r in enumerate(resumed):
        corrupted = r["corrupted"]
        assert corrupted["unchanged"]
        assert list(corrupted["failures"]) == [1]
        assert corrupted["failures"][1] == (
            "invalid snapshot of rank 1 in the checkpoint (RngState entry 'rank1'): "
            "corrupted: the SHA-256 checksum does not match"
        )
        assert corrupted["message"].startswith("RngState: restoring the random state: rank 1")
        assert corrupted["cause"] == ("InvalidSnapshotError" if rank == 1 else None)


@needs_gloo
@pytest.mark.slow
def test_a_registry_that_differs_on_one_rank_makes_every_rank_raise(resumed):
    for r in resumed:
        missing = r["missing"]
        assert missing["unchanged"]
        assert list(missing["failures"]) == [0]
        assert "'augment'" in missing["failures"][0]


@needs_gloo
@pytest.mark.slow
def test_a_larger_world_is_refused_by_dcp_or_by_the_policy(saved, tmp_path):
    path, _ = saved
    for r in launch(f"{__name__}:_scenario_grow", 3, tmp_path, str(path)):
        kind, message = r["plain"]
        assert kind == "CheckpointException"
        assert "Missing key in checkpoint state_dict: rng.rank2" in message
        assert r["policy"]["unchanged"]
        assert r["policy"]["value_error"].startswith(
            "RngState: the checkpoint holds the random state of 2 ranks, and this run has 3"
        )
        assert r["kept"]


@needs_gloo
@pytest.mark.slow
@one_process
def test_a_smaller_world_is_refused_or_keeps_its_state(saved, restore_world):
    path, _ = saved
    before = fingerprint()
    with pytest.raises(ValueError, match=r"holds the random state of 2 ranks, and this run has 1"):
        dcp.load({"rng": RngState()}, checkpoint_id=path)
    dcp.load({"rng": RngState(on_world_size_change="keep")}, checkpoint_id=path)
    assert fingerprint() == before


def test_the_cross_process_error_survives_pickling():
    err = pickle.loads(pickle.dumps(RngStateError("RngState: x", {1: "y"})))
    assert err.failures == {1: "y"}


# -- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@one_process
def test_cuda_generators_are_saved_and_restored(tmp_path, restore_world):
    torch.cuda.init()
    dcp.save({"rng": RngState(strict_devices=True)}, checkpoint_id=tmp_path)
    first = torch.rand(4, device="cuda")
    dcp.load({"rng": RngState(strict_devices=True)}, checkpoint_id=tmp_path)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_dist_is_not_initialized_here():
    # The single-process tests above assume it (rank 0 of 1).
    assert not dist.is_initialized()
