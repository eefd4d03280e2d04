"""sync_rng_state: one rank's whole random state on every rank, over real gloo groups.

The multi-process tests spawn ranks on 127.0.0.1 (bounded in time, killed on a timeout)
and run scenario functions of this module or of ``tests/state/test_dcp.py`` in them
(:func:`launch`).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from deterministic_ctx import (
    RngStreams,
    Snapshot,
    register_rng,
    seed_everything,
    unregister_rng,
)
from deterministic_ctx.state.checkpoint import encode
from deterministic_ctx.state.sync import (
    MESSAGE_BYTES,
    RngStateError,
    agree,
    apply_everywhere,
    check_everywhere,
    collective_device,
    sync_rng_state,
)
from tests.helpers import free_port, join_loopback_group, needs_gloo, spawn_ranks

#: Seconds a launch of spawned ranks may take before they are killed and the test fails.
LAUNCH_TIMEOUT = 180.0

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# -- launching ranks (also used by tests/state/test_dcp.py) ------------------------------------------


def _rank_main(
    rank: int, world: int, port: int, out: str, target: str, args: tuple[Any, ...], group: bool
) -> None:
    """One rank: join a gloo group of ``world`` (unless ``group`` is false), run
    ``target(rank, world, *args)``, write its result."""
    module, name = target.split(":")
    scenario = getattr(importlib.import_module(module), name)
    if not group:
        result = scenario(rank, world, *args)
    else:
        join_loopback_group(rank, world, port)
        try:
            result = scenario(rank, world, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def launch(target: str, world: int, tmp_path: Path, *args: Any, group: bool = True) -> list[Any]:
    """``target`` (``"module:function"``) run in ``world`` freshly spawned ranks; by rank,
    what it returned.  ``group=False``: no process group (each rank a lone process).

    Bounded: after ``LAUNCH_TIMEOUT`` seconds the ranks are killed and the test fails.
    """
    out = tmp_path / f"{target.rsplit(':', 1)[1]}-{world}-{time.monotonic_ns()}"
    out.mkdir()
    main_args = (world, free_port(), str(out), target, args, group)
    return spawn_ranks(_rank_main, main_args, world, out, timeout=LAUNCH_TIMEOUT, what=target)


def fingerprint() -> str:
    """A digest of this process's whole random state (every source of a snapshot)."""
    return hashlib.sha256(encode(Snapshot.capture().state_dict())).hexdigest()


def draws(augment: random.Random, gen: torch.Generator) -> list[float]:
    """One draw from each global RNG and from two registered ones."""
    return [
        random.random(),
        float(np.random.rand()),
        torch.rand(()).item(),
        augment.random(),
        torch.rand((), generator=gen).item(),
    ]


class Refusing:
    """A random-like RNG; with ``refuse``, its setstate raises for any state but its own."""

    def __init__(self, rank: int, refuse: bool) -> None:
        self.rank = rank
        self.n = rank
        self.refuse = refuse

    def seed(self, seed: int) -> None:
        self.n = seed

    def getstate(self) -> tuple[int, int]:
        return (self.rank, self.n)

    def setstate(self, state: tuple[int, int]) -> None:
        if self.refuse and tuple(state) != self.getstate():
            raise RuntimeError(f"rank {self.rank} refuses the state of rank {state[0]}")
        self.rank, self.n = state


# -- scenarios, run in the ranks ----------------------------------------------------------------


def _setup(rank: int) -> tuple[random.Random, torch.Generator]:
    """Per-rank state: seeded per rank, registered RNGs, and a rank-local number of draws."""
    seed_everything(5, rank=rank)
    augment = register_rng(random.Random(100 + rank), key="augment")
    gen = register_rng(torch.Generator().manual_seed(200 + rank), key="gen")
    torch.manual_seed(300 + rank)  # torch differs per rank too
    for _ in range(rank + 1):  # a rank-local draw
        draws(augment, gen)
    return augment, gen


def _scenario_sync(rank: int, world: int) -> dict[str, Any]:
    augment, gen = _setup(rank)
    result: dict[str, Any] = {"before": fingerprint()}
    snap = Snapshot.capture()
    expected = draws(augment, gen)  # what this rank draws next without a sync
    snap.restore()
    sync_rng_state(src=1)
    result["after"] = fingerprint()
    result["draws"] = draws(augment, gen)
    result["unsynced"] = expected
    # Nothing to do a second time: every rank holds rank 1's state already.
    sync_rng_state(src=1)
    result["again"] = draws(augment, gen)
    # What a sync leaves as each rank has it: a stream that varies along "tp" (another
    # rank's would be refused), and the process's setup (here an NCCL variable).
    streams = RngStreams(0, {"tp": (rank, world)})
    streams.add("tp", varies=["tp"])
    with streams.fork("tp"):
        torch.rand(rank + 1)
    os.environ["NCCL_ALGO"] = f"Ring{rank}"
    snap = Snapshot.capture()
    with streams.fork("tp"):
        result["stream_unsynced"] = torch.rand(2).tolist()
    snap.restore()
    sync_rng_state(src=1)
    with streams.fork("tp"):
        result["stream"] = torch.rand(2).tolist()
    result["nccl_algo"] = os.environ["NCCL_ALGO"]
    return result


def _expect_error(call: Any) -> dict[str, Any]:
    before = fingerprint()
    try:
        call()
    except RngStateError as exc:
        return {
            "failures": exc.failures,
            "message": str(exc),
            "cause": None if exc.__cause__ is None else type(exc.__cause__).__name__,
            "unchanged": fingerprint() == before,
        }
    except ValueError as exc:
        return {"value_error": str(exc), "unchanged": fingerprint() == before}
    return {"raised": None}


def _sync_with_a_twin(rank: int) -> None:
    """sync_rng_state(src=0) where rank 0 holds two RNGs registered under one key."""
    twin = register_rng(random.Random(), key="augment") if rank == 0 else None
    try:
        sync_rng_state(src=0)
    finally:
        if twin is not None:
            unregister_rng(twin)


def _scenario_errors(rank: int, world: int) -> dict[str, Any]:
    augment, gen = _setup(rank)
    result: dict[str, Any] = {}
    # A registered RNG missing on rank 2: caught before anything is applied.
    extra = register_rng(random.Random(), key="extra") if rank != 2 else None
    result["missing"] = _expect_error(lambda: sync_rng_state(src=0))
    if extra is not None:
        unregister_rng(extra)
    # A state rank 1 cannot apply: found while applying, so every rank goes back.
    refusing = register_rng(Refusing(rank, refuse=rank == 1), key="refusing")
    result["refused"] = _expect_error(lambda: sync_rng_state(src=0))
    unregister_rng(refusing)
    # Rank 0, the source, cannot encode its state: two RNGs share a key there.
    result["source_failed"] = _expect_error(lambda: _sync_with_a_twin(rank))
    # The ranks disagree on the source.
    result["different_src"] = _expect_error(lambda: sync_rng_state(src=0 if rank == 0 else 1))
    # Every rank names a source outside the group: every rank raises, none waits.
    result["outside_src"] = _expect_error(lambda: sync_rng_state(src=5))
    # A subgroup: ranks 0 and 2 take rank 2's state; rank 1 is not in it.
    pair = dist.new_group([0, 2])
    if rank == 1:
        result["not_member"] = _expect_error(lambda: sync_rng_state(src=2, group=pair))
    else:
        sync_rng_state(src=2, group=pair)
    result["pair"] = fingerprint()
    result["pair_draws"] = draws(augment, gen)
    return result


# -- one process ------------------------------------------------------------------------------


def test_without_a_process_group_it_does_nothing():
    before = fingerprint()
    sync_rng_state()
    sync_rng_state(src=np.int64(0))
    assert fingerprint() == before


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"src": "0"}, TypeError, r"src must be a non-negative int \(a global rank\), got str '0'"),
        ({"src": 1.0}, TypeError, r"got float 1.0"),
        ({"src": True}, TypeError, r"got bool True"),
        ({"src": -1}, ValueError, r"src must be a non-negative int \(a global rank\), got -1"),
        (
            {"src": 1},
            ValueError,
            r"without a process group this process is the only rank, 0; got 1",
        ),
        ({"group": "world"}, TypeError, r"group must be a torch.distributed ProcessGroup or None"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, error, message):
    with pytest.raises(error, match=message):
        sync_rng_state(**kwargs)


def test_the_error_names_every_failing_rank_and_survives_pickling():
    err = RngStateError("sync_rng_state from rank 0", {3: "b", 1: "a"})
    assert str(err) == (
        "sync_rng_state from rank 0: ranks 1, 3 failed, so no rank changed its random state: "
        "rank 1: a; rank 3: b"
    )
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is RngStateError
    assert again.failures == {1: "a", 3: "b"}
    assert str(again) == str(err)


def test_one_process_raises_its_own_problem_and_applies_its_own_snapshot():
    problem = ValueError("nope")
    with pytest.raises(ValueError, match="nope"):
        check_everywhere("what", problem)
    check_everywhere("what", None)
    snap = Snapshot.capture()
    first = random.random()
    apply_everywhere(snap, None, "what")
    assert random.random() == first
    snap.restore()


@needs_gloo
def test_a_group_of_one_rank_has_nothing_to_send(gloo_of_one):
    before = fingerprint()
    sync_rng_state(0)
    assert fingerprint() == before
    assert collective_device() == torch.device("cpu")
    with pytest.raises(ValueError, match=r"src 1 is not a rank of the group; its ranks are 0"):
        sync_rng_state(1)
    assert agree(None) == {}
    assert agree("too long " * 500) == {0: ("too long " * 500)[:MESSAGE_BYTES]}


# -- real process groups ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(f"{__name__}:_scenario_sync", 3, tmp_path_factory.mktemp("sync"))


@needs_gloo
@pytest.mark.slow
def test_every_rank_takes_the_source_ranks_whole_state(three_ranks):
    src = three_ranks[1]
    assert len({r["before"] for r in three_ranks}) == 3  # the ranks differed
    # After: the same state everywhere, the registered RNGs included, and it is rank 1's,
    # which rank 1 kept (their flags and environment were the same to begin with).
    assert {r["after"] for r in three_ranks} == {src["before"]}
    for r in three_ranks:
        assert r["draws"] == src["unsynced"]
        assert r["again"] == src["again"]
    assert three_ranks[0]["unsynced"] != src["unsynced"]
    for rank, r in enumerate(three_ranks):
        assert r["stream"] == r["stream_unsynced"]  # each rank's own stream, continued
        assert r["nccl_algo"] == f"Ring{rank}"  # and its own setup
    assert three_ranks[0]["stream"] != three_ranks[2]["stream"]


@needs_gloo
@pytest.mark.slow
def test_a_source_outside_the_group_is_refused_on_every_rank(three_ranks_errors):
    for r in three_ranks_errors:
        assert r["outside_src"]["unchanged"]
        assert "src 5 is not a rank of the group" in r["outside_src"]["value_error"]


@pytest.fixture(scope="module")
def three_ranks_errors(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return launch(f"{__name__}:_scenario_errors", 3, tmp_path_factory.mktemp("sync-errors"))


@needs_gloo
@pytest.mark.slow
def test_a_rank_that_cannot_apply_it_makes_every_rank_raise_before_anything_changes(
    three_ranks_errors,
):
    for rank, r in enumerate(three_ranks_errors):
        missing = r["missing"]
        assert missing["unchanged"]
        assert list(missing["failures"]) == [2]
        assert missing["failures"][2].startswith(
            "cannot restore snapshot from rank 0 here: it holds user RNG 'extra'"
        )
        assert missing["message"].startswith("sync_rng_state from rank 0: rank 2 failed")
        assert missing["cause"] == ("UnregisteredRngError" if rank == 2 else None)


@needs_gloo
@pytest.mark.slow
def test_a_failure_while_applying_puts_every_rank_back(three_ranks_errors):
    for rank, r in enumerate(three_ranks_errors):
        refused = r["refused"]
        assert refused["unchanged"]  # rank 2 had applied it: it was rolled back
        assert refused["failures"] == {1: refused["failures"][1]}
        assert "rank 1 refuses the state of rank 0" in refused["failures"][1]
        assert refused["cause"] == ("RestoreError" if rank == 1 else None)


@needs_gloo
@pytest.mark.slow
def test_a_source_that_cannot_send_makes_every_rank_raise(three_ranks_errors):
    for r in three_ranks_errors:
        failed = r["source_failed"]
        assert failed["unchanged"]
        assert list(failed["failures"]) == [0]
        assert failed["failures"][0].startswith("ValueError: ")
        assert "augment" in failed["failures"][0]


@needs_gloo
@pytest.mark.slow
def test_ranks_that_name_different_sources_all_raise(three_ranks_errors):
    for r in three_ranks_errors:
        assert r["different_src"]["unchanged"]
        assert "the ranks passed different src (from 0 to 1)" in r["different_src"]["value_error"]


@needs_gloo
@pytest.mark.slow
def test_a_subgroup_syncs_its_members_only(three_ranks_errors):
    zero, one, two = three_ranks_errors
    assert zero["pair"] == two["pair"] != one["pair"]
    assert zero["pair_draws"] == two["pair_draws"] != one["pair_draws"]
    assert "is not a member of group" in one["not_member"]["value_error"]


# -- CUDA ---------------------------------------------------------------------------------------


def _scenario_cuda(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.init()
    torch.cuda.manual_seed_all(rank)
    sync_rng_state(src=0)
    return {"cuda": torch.rand(4, device="cuda").tolist()}


@pytest.mark.gpu
@needs_cuda
@needs_gloo
def test_cuda_generators_travel_too(tmp_path):
    ranks = launch(f"{__name__}:_scenario_cuda", 2, tmp_path)
    assert ranks[0]["cuda"] == ranks[1]["cuda"]
    torch.cuda.init()
    with torch.random.fork_rng(devices=[0]):
        torch.cuda.manual_seed_all(0)
        assert torch.rand(4, device="cuda").tolist() == ranks[0]["cuda"]
