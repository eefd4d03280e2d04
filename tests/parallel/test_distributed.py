"""Per-rank seeds, seed broadcast, and real gloo process groups on loopback.

The DDP example is run by ``tests/docs/test_examples.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler

import deterministic_ctx.base.settings as settings_module
import deterministic_ctx.parallel.seeding as seeding_module
from deterministic_ctx import (
    derive_seed,
    deterministic,
    register_rng,
    reproducible,
    seed_everything,
    unregister_rng,
)
from deterministic_ctx.internal import SEED_ENV_VAR, inside_block
from deterministic_ctx.parallel.data import chain_worker_init, seed_worker, seeded_generator
from deterministic_ctx.parallel.ranks import broadcast_seed, rank_seed, resolve_rank
from tests.core.test_interrupts import _lock_free
from tests.helpers import free_port, join_loopback_group, needs_gloo, spawn_ranks
from tests.parallel.test_data import WORKER, Augmenting

LAUNCH_TIMEOUT = 180.0


def draws(n: int = 3) -> list[tuple[float, float, float]]:
    return [(random.random(), float(np.random.rand()), torch.rand(()).item()) for _ in range(n)]


# -- per-rank seeds, in one process -------------------------------------------------------


def test_rank_seed_is_the_seed_on_rank_zero_and_well_mixed_elsewhere():
    assert rank_seed(7, 0) == rank_seed(7, None) == rank_seed(7, "auto") == 7
    assert rank_seed(7, 1) == derive_seed(7, "rank", 1)
    assert rank_seed(0, 1) != rank_seed(1, 0)  # ``seed + rank`` collides here
    grid = {rank_seed(s, r) for s in range(64) for r in range(64)}
    assert len(grid) == 64 * 64


def test_rank_zero_draws_the_classic_recipe():
    with deterministic(seed=4, rank=0):
        ranked = draws()
    with deterministic(seed=4):
        plain = draws()
    with deterministic(seed=4):
        random.seed(4)
        np.random.seed(4)
        torch.manual_seed(4)
        classic = draws()
    assert ranked == plain == classic


def test_other_ranks_reseed_python_numpy_and_user_rngs_but_share_torch():
    user = register_rng(random.Random(), key="augment")
    try:
        with deterministic(seed=4, rank=2):
            got = draws(1)[0] + (user.random(),)
        with deterministic(seed=4):
            shared_torch = torch.rand(()).item()
    finally:
        unregister_rng(user)
    per_rank = rank_seed(4, 2)
    expected_user = random.Random(derive_seed(per_rank, "user", "augment", bits=64)).random()
    assert got == (
        random.Random(per_rank).random(),
        float(np.random.RandomState(per_rank).rand()),
        shared_torch,
        expected_user,
    )


def test_auto_rank_is_looked_up_each_time_a_block_starts(monkeypatch):
    block = deterministic(seed=4, rank="auto")
    decorated = reproducible(seed=4, rank="auto")(draws)
    with block:
        rank0 = draws()
    monkeypatch.setattr(settings_module, "process_rank", lambda: 3)
    with block:
        rank3 = draws()
    with deterministic(seed=4, rank=3):
        explicit = draws()
    assert rank3 == explicit == decorated()
    assert rank3 != rank0
    assert [d[2] for d in rank3] == [d[2] for d in rank0]  # torch is shared


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rank=st.integers(0, 10_000))
def test_per_rank_law(seed, rank):
    # Every rank: torch draws the shared seed's numbers, random and NumPy the rank seed's.
    with deterministic(seed=seed, rank=rank):
        got = draws(1)[0]
    with deterministic(seed=seed):
        shared_torch = torch.rand(()).item()
    per_rank = rank_seed(seed, rank)
    assert got == (
        random.Random(per_rank).random(),
        float(np.random.RandomState(per_rank).rand()),
        shared_torch,
    )


def test_reproducible_takes_a_rank():
    @reproducible(seed=4, rank=1)
    def sample():
        return draws()

    with deterministic(seed=4, rank=1):
        expected = draws()
    assert sample() == expected


@pytest.mark.parametrize(
    ("rank", "error", "message"),
    [
        (-1, ValueError, r"rank must be a non-negative int, 'auto' or None, got -1"),
        ("1", ValueError, r"rank must be a non-negative int, 'auto' or None, got '1'"),
        (1.0, TypeError, r"rank must be a non-negative int, 'auto' or None, got float 1.0"),
        (True, TypeError, r"got bool True"),
        (np.bool_(False), TypeError, r"got bool_? (np\.)?False"),  # NumPy 2's repr, or 1.x's
    ],
)
def test_bad_ranks_are_rejected_where_they_are_written(rank, error, message):
    with pytest.raises(error, match=message):
        deterministic(seed=0, rank=rank)
    with pytest.raises(error, match=message):
        reproducible(seed=0, rank=rank)
    with pytest.raises(error, match=message):
        seed_everything(0, rank=rank)  # fails before changing anything
    with pytest.raises(error, match=message):
        resolve_rank(rank)


def test_the_rank_shows_on_the_object():
    det = deterministic(seed=1, rank=np.int64(2))
    assert det.rank == 2
    assert type(det.rank) is int
    assert repr(det) == "deterministic(seed=1, warn_only=False, rank=2)"
    assert repr(deterministic(seed=1, rank="auto")).endswith("rank='auto')")
    assert repr(deterministic(seed=1)) == "deterministic(seed=1, warn_only=False)"


# -- seed_everything and broadcast_seed, in one process ---------------------------------


def test_seed_everything_applies_the_block_per_rank(restore_world):
    with deterministic(seed=6, rank=1):
        expected = draws()
    assert seed_everything(6, rank=1) == 6
    assert draws() == expected


def test_seed_everything_draws_logs_and_replays_a_fresh_seed(restore_world, caplog):
    with caplog.at_level(logging.INFO, logger="deterministic_ctx"):
        seed = seed_everything(None)
    assert 0 <= seed < 2**32
    assert f"seed {seed} (drawn fresh" in caplog.text
    first = draws()
    assert seed_everything(seed) == seed
    assert draws() == first
    assert seed_everything(None) != seed  # fresh each time (a 2**-32 chance of a false alarm)


def test_seed_everything_stopped_before_its_commit_and_again_in_the_undo_changes_nothing(
    monkeypatch,
):
    # A signal while the seed is exported, a second one at the first line of
    # the block's stop that undoes it: the stop is run again and finished, and
    # nothing stays applied, exported or locked.
    exported = os.environ.get(SEED_ENV_VAR)
    state = (random.getstate(), np.random.get_state(legacy=False), torch.get_rng_state())

    def signal_while_exporting(name: str, value: str) -> None:
        raise KeyboardInterrupt("while exporting")

    fired: list[str] = []

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if (
            event == "line"
            and not fired
            and code.co_name == "stop"
            and "engine" in code.co_filename
        ):
            fired.append(code.co_name)
            raise KeyboardInterrupt("in the undo")
        return tracer

    monkeypatch.setattr(seeding_module, "export_env_var", signal_while_exporting)
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            seed_everything(9)
    finally:
        sys.settrace(None)
    assert fired
    assert not inside_block() and _lock_free()
    assert os.environ.get(SEED_ENV_VAR) == exported
    assert random.getstate() == state[0]
    assert np.array_equal(
        np.random.get_state(legacy=False)["state"]["key"], state[1]["state"]["key"]
    )
    assert torch.equal(torch.get_rng_state(), state[2])


def test_broadcast_without_a_process_group_is_a_no_op(restore_world):
    assert seed_everything(5, broadcast=True) == 5
    assert 0 <= seed_everything(None, broadcast=True) < 2**32
    assert broadcast_seed(7) == 7
    assert 0 <= broadcast_seed() < 2**32


def test_drawing_a_seed_inside_a_block_leaves_its_streams_alone():
    with deterministic(seed=2):
        broadcast_seed()
        inside = draws()
    with deterministic(seed=2):
        assert draws() == inside


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: seed_everything(0, broadcast=1), TypeError, "broadcast must be True or False"),
        (lambda: seed_everything(-3, broadcast=True), ValueError, "seed must be in"),
        (lambda: broadcast_seed(2**32), ValueError, "seed must be in"),
        (lambda: broadcast_seed("7"), TypeError, "seed must be an int"),
    ],
)
def test_seed_arguments_are_validated(call, error, message):
    with pytest.raises(error, match=message):
        call()


# -- real process groups --------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, out: str, scenarios: tuple[str, ...]) -> None:
    """The body of one rank: join the group, run ``scenarios`` in turn, write their results."""
    join_loopback_group(rank, world, port)
    try:
        result = {name: SCENARIOS[name](rank, world) for name in scenarios}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def launch(scenarios: tuple[str, ...], world: int, tmp_path: Path) -> list[dict[str, Any]]:
    """Run ``scenarios``, one after the other, on ``world`` spawned ranks; by rank, the
    results by scenario.

    Bounded: after ``LAUNCH_TIMEOUT`` seconds the ranks are killed and the test fails.
    """
    scenario = "+".join(scenarios)
    out = tmp_path / f"{scenario}-{world}-{time.monotonic_ns()}"
    out.mkdir()
    args = (world, free_port(), str(out), scenarios)
    return spawn_ranks(_rank_main, args, world, out, timeout=LAUNCH_TIMEOUT, what=scenario)


def pipeline(
    rank: int | str, world: int, worker_init_fn, context: str | None, *, sharded: bool = True
) -> dict[str, Any]:
    """Draws, then loaders, inside one block; the same code runs in ranks and locally.

    ``worker_rows``: a loader with the same indices on every rank and no
    generator, so its workers' base seed is shared: only the rank mixed in by
    ``worker_init_fn`` tells ranks apart.  ``sharded``: the recommended
    setup, ``DistributedSampler`` plus a per-rank generator, for two epochs.
    """
    sampler_rank = resolve_rank(rank)
    with deterministic(seed=11, rank=rank) as det:
        result: dict[str, Any] = {"draws": draws()}
        loader = DataLoader(
            Augmenting(),
            batch_size=2,
            num_workers=2,
            multiprocessing_context=context,
            worker_init_fn=worker_init_fn,
        )
        result["worker_rows"] = torch.cat(list(loader))
        if not sharded:
            return result
        sampler = DistributedSampler(
            Augmenting(), num_replicas=world, rank=sampler_rank, seed=det.seed
        )
        sharded = DataLoader(
            Augmenting(),
            batch_size=2,
            sampler=sampler,
            num_workers=2,
            multiprocessing_context=context,
            worker_init_fn=worker_init_fn,
            generator=seeded_generator(det),
        )
        result["sharded"] = []
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            result["sharded"].append(torch.cat(list(sharded)))
    return result


def _scenario_pipeline(rank: int, world: int) -> dict[str, Any]:
    return {
        "fork": pipeline("auto", world, seed_worker, "fork"),
        # Spawned workers start slowly (they import torch): one loader is enough.
        "spawn": pipeline("auto", world, seed_worker, "spawn", sharded=False),
        "no_seed_worker": pipeline("auto", world, None, "fork", sharded=False),
    }


def _scenario_pipeline_again(rank: int, world: int) -> dict[str, Any]:
    return {"fork": pipeline("auto", world, seed_worker, "fork")}


def _scenario_broadcast(rank: int, world: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    result["drawn"] = seed_everything(None, rank="auto", broadcast=True)
    result["draws"] = draws()
    result["again"] = seed_everything(None, rank="auto", broadcast=True)
    result["given"] = seed_everything(100 + rank, rank="auto", broadcast=True)
    seed_everything(result["drawn"], rank="auto")
    result["replay"] = draws()
    with deterministic(seed=result["drawn"], rank="auto"):
        result["block"] = draws()
    try:
        seed_everything(None, rank="auto")
    except ValueError as exc:
        result["refused"] = str(exc)
    return result


SCENARIOS = {
    "pipeline": _scenario_pipeline,
    "pipeline_again": _scenario_pipeline_again,
    "broadcast": _scenario_broadcast,
}


def _columns(rows: torch.Tensor) -> set[float]:
    return set(rows[:, 2:5].flatten().tolist())  # the random, NumPy and torch draws


HAS_FORK = "fork" in multiprocessing.get_all_start_methods()
needs_fork = pytest.mark.skipif(not HAS_FORK, reason="needs the fork start method")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One launch on 2 ranks, shared by the tests below: the pipeline, then the broadcast.

    Each scenario is independent of what ran before it in the rank: the pipeline draws only
    inside blocks, the broadcast seeds everything itself.
    """
    scenarios = ("pipeline", "broadcast") if HAS_FORK else ("broadcast",)
    return launch(scenarios, 2, tmp_path_factory.mktemp("two-ranks"))


@needs_gloo
@needs_fork
@pytest.mark.slow
def test_ranks_differ_and_whole_runs_repeat(two_ranks, tmp_path):
    first = [r["pipeline"] for r in two_ranks]
    second = [r["pipeline_again"] for r in launch(("pipeline_again",), 2, tmp_path)]
    for a, b in zip(first, second, strict=True):
        assert a["fork"]["draws"] == b["fork"]["draws"]
        assert torch.equal(a["fork"]["worker_rows"], b["fork"]["worker_rows"])
        for x, y in zip(a["fork"]["sharded"], b["fork"]["sharded"], strict=True):
            assert torch.equal(x, y)

    for rank, got in enumerate(first):
        # "auto" found the rank in the group, in the rank and in its workers
        # (forked ones inherit the group, spawned ones were told by the parent).
        local = pipeline(rank, 2, chain_worker_init(rank=rank), "fork")
        for variant in ("fork", "spawn"):
            assert got[variant]["draws"] == local["draws"]
            assert torch.equal(got[variant]["worker_rows"], local["worker_rows"])
        for x, y in zip(got["fork"]["sharded"], local["sharded"], strict=True):
            assert torch.equal(x, y)

    zero, one = (r["fork"] for r in first)
    # random and NumPy per rank, torch shared (model init must agree).
    assert [d[:2] for d in zero["draws"]] != [d[:2] for d in one["draws"]]
    assert [d[2] for d in zero["draws"]] == [d[2] for d in one["draws"]]
    # Workers: no stream shared between ranks or between workers.
    assert not _columns(zero["worker_rows"]) & _columns(one["worker_rows"])
    rows = zero["worker_rows"]
    assert not _columns(rows[rows[:, WORKER] == 0]) & _columns(rows[rows[:, WORKER] == 1])
    # Without seed_worker, every rank's workers draw the same augmentation.
    plain0, plain1 = (r["no_seed_worker"]["worker_rows"] for r in first)
    assert torch.equal(plain0, plain1)
    # DistributedSampler: the ranks split each epoch's permutation.
    for epoch in (0, 1):
        indices = [set(r["fork"]["sharded"][epoch][:, 0].tolist()) for r in first]
        assert not indices[0] & indices[1]
        assert indices[0] | indices[1] == set(range(8))
    assert zero["sharded"][0][:, 0].tolist() != zero["sharded"][1][:, 0].tolist()


@needs_gloo
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_broadcast_gives_every_rank_rank_zeros_seed(request, tmp_path, world):
    if world == 2:
        ranks = request.getfixturevalue("two_ranks")
    else:
        ranks = launch(("broadcast",), world, tmp_path)
    results = [r["broadcast"] for r in ranks]
    drawn = results[0]["drawn"]
    assert all(r["drawn"] == drawn for r in results)
    assert all(r["again"] == results[0]["again"] != drawn for r in results)
    assert all(r["given"] == 100 for r in results)
    for rank, r in enumerate(results):
        assert r["replay"] == r["draws"] == r["block"]
        with deterministic(seed=drawn, rank=rank):
            assert draws() == r["draws"]
        assert "pass broadcast=True" in r["refused"]
    python_draws = {r["draws"][0][0] for r in results}
    torch_draws = {r["draws"][0][2] for r in results}
    assert len(python_draws) == world
    assert len(torch_draws) == 1
