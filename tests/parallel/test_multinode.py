"""Multi-node runs: ``rank="auto"`` and everything rank-aware under real ``torchrun`` agents.

Two launches serve every slow test here (module fixture ``launches``): 2 nodes x 2 processes
(two agents on loopback, c10d rendezvous) and 1 node x 4.  Each worker runs this module
(``python -m tests.parallel.test_multinode``: :func:`_rank_main`), seeds before and after
``init_process_group("gloo")``, and reports what it drew.  The fast tests read the launcher's
variables in this process.
"""

from __future__ import annotations

import importlib
import os
import random
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from deterministic_ctx import (
    MisuseError,
    deterministic,
    register_rng,
    reproducible,
    seed_everything,
    unregister_rng,
)
from deterministic_ctx.base.fast_paths import ENABLED as _FAST
from deterministic_ctx.parallel.data import chain_worker_init, seed_worker, seeded_generator
from deterministic_ctx.parallel.ranks import (
    Ranks,
    broadcast_seed,
    rank_seed,
    ranks,
    resolve_rank,
)
from tests.helpers import needs_gloo
from tests.parallel.test_data import NUMPY, RANDOM, TORCH, USER, WORKER, Augmenting
from tests.parallel.torchrun import LaunchError, _tagged, report, torchrun

SEED = 11
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")

needs_fork = pytest.mark.skipif(
    not hasattr(os, "fork") or not os.path.isdir("/proc"),
    reason="the launches use fork workers; cleanup is checked through /proc",
)


# -- what every rank does (also run here, with an explicit rank, as the reference) -------


def facts(user: random.Random, rank: int | str) -> dict[str, Any]:
    """Draws from every per-rank and shared source, in a fixed order, as JSON data.

    ``workers``: a loader whose base seed comes from torch's (shared) generator, so only the
    rank that ``seed_worker`` mixes in tells ranks' workers apart.
    """
    loader = DataLoader(
        Augmenting(rng=user),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
        worker_init_fn=seed_worker if rank == "auto" else chain_worker_init(rank=rank),
    )
    return {
        "random": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist(),
        "torch": torch.rand(3).tolist(),
        "user": [user.random() for _ in range(3)],
        "workers": torch.cat(list(loader)).tolist(),
        "shuffle": torch.randperm(8, generator=seeded_generator(SEED, rank=rank)).tolist(),
        "shared_shuffle": torch.randperm(8, generator=seeded_generator(SEED)).tolist(),
    }


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), torch.rand(()).item()]


def _refusal(call: Any) -> list[str]:
    try:
        call()
    except (ValueError, RuntimeError) as exc:
        return [type(exc).__name__, str(exc)]
    return ["nothing", ""]


def _rank_main() -> None:
    """One torchrun worker: seed before ``init_process_group``, then after; report it all."""
    user = register_rng(random.Random(5), key="augment")
    result: dict[str, Any] = {
        "env": {name: os.environ.get(name) for name in LAUNCHER_VARS},
        "ranks_before": list(ranks()),
        "refused": [
            _refusal(lambda: seed_everything(None, rank="auto")),
            _refusal(lambda: seed_everything(None, rank="auto", broadcast=True)),
            _refusal(lambda: broadcast_seed(3)),
        ],
    }
    seed_everything(SEED, rank="auto")
    result["before"] = facts(user, "auto")
    with deterministic(seed=SEED, rank="auto"):
        result["block_before"] = facts(user, "auto")
    # Under torchrun, init_process_group reads everything from the environment.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        result["ranks_after"] = list(ranks())
        seed_everything(SEED, rank="auto")
        result["after"] = facts(user, "auto")
        with deterministic(seed=SEED, rank="auto"):
            result["block_after"] = facts(user, "auto")
        drawn = seed_everything(None, rank="auto", broadcast=True)
        result["broadcast"] = {"seed": drawn, "draws": draws()}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    report(result)


# -- the launches ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def launches() -> dict[str, list[dict[str, Any]]]:
    """Each rank's report, by layout: ``"2x2"`` (two agents as two nodes) and ``"1x4"``."""
    return {
        f"{nnodes}x{nproc}": list(
            torchrun(
                "tests.parallel.test_multinode", module=True, nnodes=nnodes, nproc_per_node=nproc
            ).results
        )
        for nnodes, nproc in ((2, 2), (1, 4))
    }


@pytest.fixture
def user_rng() -> Iterator[random.Random]:
    rng = register_rng(random.Random(5), key="augment")
    yield rng
    unregister_rng(rng)


def reference(rank: int, user: random.Random) -> dict[str, Any]:
    """What global rank ``rank`` must draw, computed here with the rank given by hand."""
    with deterministic(seed=SEED, rank=rank):
        return facts(user, rank)


@needs_gloo
@needs_fork
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["2x2", "1x4"])
def test_torchrun_gives_each_process_its_global_local_and_node_rank(launches, layout):
    nproc = int(layout[-1])
    for rank, r in enumerate(launches[layout]):
        # torchrun numbers ranks node after node: rank = node * nproc + local.
        expected = {
            "RANK": rank,
            "WORLD_SIZE": 4,
            "LOCAL_RANK": rank % nproc,
            "LOCAL_WORLD_SIZE": nproc,
            "GROUP_RANK": rank // nproc,
        }
        assert r["env"] == {name: str(value) for name, value in expected.items()}
        assert r["ranks_before"] == r["ranks_after"] == [rank, 4, rank % nproc, rank // nproc]


@needs_gloo
@needs_fork
@pytest.mark.slow
def test_seeding_before_init_process_group_seeds_what_seeding_after_does(launches):
    for r in launches["2x2"] + launches["1x4"]:
        assert r["before"] == r["after"] == r["block_before"] == r["block_after"]


@needs_gloo
@needs_fork
@pytest.mark.slow
def test_per_rank_streams_differ_across_nodes_and_torch_agrees(launches):
    got = [r["after"] for r in launches["2x2"]]
    for name in ("random", "numpy", "user", "shuffle"):
        assert len({tuple(g[name]) for g in got}) == 4, name  # every rank its own
    for name in ("torch", "shared_shuffle"):
        assert len({tuple(g[name]) for g in got}) == 1, name  # model init must agree
    # Workers: no stream shared by any two of the 8 workers (4 ranks x 2), in any RNG,
    # even between local rank 0 of node 0 and local rank 0 of node 1.
    for column in (RANDOM, NUMPY, TORCH, USER):
        streams = [
            {row[column] for row in g["workers"] if row[WORKER] == worker}
            for g in got
            for worker in (0, 1)
        ]
        assert sum(map(len, streams)) == len(set().union(*streams)) == 32, column


@needs_gloo
@needs_fork
@pytest.mark.slow
def test_seeds_depend_on_the_global_rank_only(launches, user_rng):
    # The same global rank has another local and node rank in each layout (rank 2: local 0 of
    # node 1, or local 2 of node 0), and draws the same: with the rank given by hand, here.
    # Three whole runs (two launches and this process) agree, so runs repeat.
    for rank in range(4):
        expected = reference(rank, user_rng)
        assert launches["2x2"][rank]["after"] == expected
        assert launches["1x4"][rank]["after"] == expected


@needs_gloo
@needs_fork
@pytest.mark.slow
def test_broadcast_needs_the_process_group_and_then_agrees(launches):
    for r in launches["2x2"]:
        refused_none, refused_broadcast, refused_seed = r["refused"]
        assert refused_none[0] == "ValueError"
        assert "pass broadcast=True" in refused_none[1]
        for refused in (refused_broadcast, refused_seed):
            assert refused[0] == "MisuseError"  # a RuntimeError
            assert "WORLD_SIZE=4" in refused[1]
            assert "init_process_group() first" in refused[1]
    seeds = {r["broadcast"]["seed"] for r in launches["2x2"]}
    assert len(seeds) == 1
    (drawn,) = seeds
    for rank, r in enumerate(launches["2x2"]):
        with deterministic(seed=drawn, rank=rank):
            assert r["broadcast"]["draws"] == draws()
    assert launches["1x4"][0]["broadcast"]["seed"] != drawn  # fresh per run (2**-32 false alarm)


# -- the launcher's variables, in this process ----------------------------------------------


@contextmanager
def launched(**variables: int | str | None) -> Iterator[None]:
    """The launcher's variables set as given (``None``: unset), and put back after."""
    saved = {name: os.environ.get(name) for name in LAUNCHER_VARS}
    try:
        for name in LAUNCHER_VARS:
            value = variables.get(name)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def torchrun_vars(rank: int, nnodes: int, nproc: int) -> dict[str, int]:
    """What torchrun exports to global rank ``rank`` of ``nnodes`` x ``nproc``."""
    return {
        "RANK": rank,
        "WORLD_SIZE": nnodes * nproc,
        "LOCAL_RANK": rank % nproc,
        "LOCAL_WORLD_SIZE": nproc,
        "GROUP_RANK": rank // nproc,
    }


def test_auto_is_the_launchers_global_rank_before_init_process_group():
    with launched(**torchrun_vars(3, 2, 2)):
        assert ranks() == Ranks(rank=3, world_size=4, local_rank=1, node_rank=1)
        assert resolve_rank("auto") == 3
        assert ranks().world_size == 4
        assert rank_seed(SEED, "auto") == rank_seed(SEED, 3)
        assert seeded_generator(SEED, rank="auto").initial_seed() == (
            seeded_generator(SEED, rank=3).initial_seed()
        )
        block = deterministic(seed=SEED, rank="auto")
        with block:
            auto = draws()
        sample = reproducible(seed=SEED, rank="auto")(draws)
        decorated = sample()
    with deterministic(seed=SEED, rank=3):
        assert auto == decorated == draws()
    # Built under the launcher, looked up when it starts: here, rank 0 again.
    with block:
        assert draws() != auto


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    layout=st.sampled_from([(1, 1), (1, 4), (2, 2), (4, 1), (3, 8), (16, 8)]).flatmap(
        lambda nn_np: st.tuples(st.just(nn_np), st.integers(0, nn_np[0] * nn_np[1] - 1))
    ),
)
def test_only_the_global_rank_enters_seeds(seed, layout):
    (nnodes, nproc), rank = layout
    with launched(**torchrun_vars(rank, nnodes, nproc)), deterministic(seed=seed, rank="auto"):
        auto = draws()
    with deterministic(seed=seed, rank=rank):  # no launcher, no layout: the rank alone
        assert draws() == auto


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"RANK": "one", "WORLD_SIZE": 2}, r"RANK='one' is not a non-negative int"),
        ({"RANK": " 1", "WORLD_SIZE": 2}, r"RANK=' 1' is not a non-negative int"),
        ({"RANK": "-1", "WORLD_SIZE": 2}, r"RANK='-1' is not a non-negative int"),
        ({"RANK": 0, "WORLD_SIZE": 0}, r"WORLD_SIZE='0' is not a positive int"),
        ({"RANK": 2, "WORLD_SIZE": 2}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"RANK": 1, "WORLD_SIZE": 4, "LOCAL_RANK": "x"}, r"LOCAL_RANK='x' is not"),
        (
            {"RANK": 1, "WORLD_SIZE": 4, "LOCAL_RANK": 2, "LOCAL_WORLD_SIZE": 2},
            "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2",
        ),
        ({"RANK": 1, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 8}, "LOCAL_WORLD_SIZE=8 exceeds"),
        ({"RANK": 1, "WORLD_SIZE": 4, "GROUP_RANK": 4}, "GROUP_RANK=4 is not below WORLD_SIZE"),
    ],
)
def test_malformed_launcher_variables_are_named(variables, message):
    with launched(**variables):
        for call in (
            lambda: resolve_rank("auto"),
            ranks,
            lambda: deterministic(seed=0, rank="auto").__enter__(),
            lambda: seed_everything(0, rank="auto"),
        ):
            with pytest.raises(ValueError, match=message):
                call()
        # An explicit rank reads no variable.
        with deterministic(seed=0, rank=1):
            pass


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"RANK": 1}, "RANK is set but WORLD_SIZE is not"),
        # Lightning's launcher: WORLD_SIZE, LOCAL_RANK and NODE_RANK, never RANK.
        ({"WORLD_SIZE": 2, "LOCAL_RANK": 1, "NODE_RANK": 0}, "WORLD_SIZE is set but RANK is not"),
    ],
)
def test_half_a_launcher_warns_and_means_rank_0_until_a_group_exists(variables, message):
    distributed = importlib.import_module("deterministic_ctx._torch.distributed")
    distributed._WARNED_PARTIAL.clear()
    with launched(**variables):
        with pytest.warns(RuntimeWarning, match=message):
            assert resolve_rank("auto") == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            with deterministic(seed=0, rank="auto"):
                pass
    distributed._WARNED_PARTIAL.clear()


@needs_gloo
def test_lightnings_launcher_variables_do_not_matter_once_the_group_exists(gloo_of_one):
    # Lightning exports WORLD_SIZE (its size), LOCAL_RANK and NODE_RANK but no RANK, then calls
    # init_process_group(rank=...): the group decides, nothing is refused or warned about.
    with launched(WORLD_SIZE=1, LOCAL_RANK=0, NODE_RANK=0), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_rank("auto") == 0
        assert ranks() == Ranks(0, 1, 0, 0)
        with deterministic(seed=0, rank="auto"):
            pass
    with launched(RANK="x", WORLD_SIZE=1):  # malformed, but the group is the truth
        assert resolve_rank("auto") == 0


def test_stray_local_variables_without_rank_are_ignored():
    with launched(LOCAL_RANK=1, GROUP_RANK=5):
        assert ranks() == Ranks(0, 1, 0, 0)


def test_a_launcher_of_several_processes_needs_the_group_to_broadcast():
    with launched(**torchrun_vars(1, 1, 2)):
        with pytest.raises(MisuseError, match=r"started 2 processes .*init_process_group\(\)"):
            broadcast_seed(5)
        with pytest.raises(MisuseError, match=r"init_process_group\(\) first"):
            seed_everything(None, rank="auto", broadcast=True)
        with pytest.raises(ValueError, match="pass broadcast=True"):
            seed_everything(None, rank="auto")
    with launched(**torchrun_vars(0, 1, 1)):  # one process: nothing to agree with
        assert broadcast_seed(5) == 5


@needs_gloo
def test_the_group_wins_over_inherited_launcher_variables_with_a_warning(gloo_of_one):
    import deterministic_ctx._torch.distributed as distributed

    with launched():  # spawned by hand: no launcher
        assert ranks() == Ranks(0, 1, 0, 0)
    with launched(**torchrun_vars(0, 1, 1)):
        assert ranks() == Ranks(0, 1, 0, 0)
        assert resolve_rank("auto") == 0
    distributed._WARNED.clear()
    with launched(**torchrun_vars(1, 1, 2)):  # inherited from a worker of another job
        with pytest.warns(
            RuntimeWarning, match=r"the process group says rank 0 of 1, but .* RANK=1, WORLD_SIZE=2"
        ):
            assert resolve_rank("auto") == 0  # the group's rank
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            assert resolve_rank("auto") == 0
            assert ranks().rank == 0
        assert resolve_rank(1) == 1  # given by hand, nothing is looked up
    distributed._WARNED.clear()


@needs_gloo
def test_auto_is_asked_again_when_the_group_or_the_launcher_changes():
    # rank="auto" is looked up at every block; its answer is remembered for the same
    # default group and launcher variables only (sources of truth that can change).
    settings = deterministic(seed=SEED, rank="auto")._settings
    with launched(**torchrun_vars(3, 2, 2)):
        assert resolve_rank("auto") == 3
        # Built once per rank where settings are cached (the fast paths; with
        # DETERMINISTIC_CTX_NO_FAST_PATHS=1 nothing is remembered, so only equal).
        assert settings.resolved() == settings.resolved()
        assert (settings.resolved() is settings.resolved()) == _FAST
        assert settings.resolved().rank == 3
        with launched(**torchrun_vars(2, 2, 2)):
            assert resolve_rank("auto") == 2
        assert resolve_rank("auto") == 3
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the group wins over the launcher: said once
                assert resolve_rank("auto") == 0
                assert settings.resolved().rank == 0
        finally:
            dist.destroy_process_group()
        assert resolve_rank("auto") == 3  # the group is gone: the launcher again
        assert settings.resolved().rank == 3
    with launched(RANK="x", WORLD_SIZE=1):  # malformed: raised every time, never remembered
        for _ in range(2):
            with pytest.raises(ValueError, match="RANK='x'"):
                resolve_rank("auto")


# -- the launcher itself ----------------------------------------------------------------------


@needs_fork
@pytest.mark.slow
def test_a_timed_out_launch_leaves_no_process_behind():
    # The workers (in sessions of their own) say they started, then outlive the timeout.
    script = "echo worker started; exec sleep 600"
    with pytest.raises(LaunchError, match="did not finish within the timeout") as caught:
        torchrun("sh", "-c", script, no_python=True, timeout=20)
    assert caught.value.output.count("worker started") == 4
    assert _tagged(caught.value.tag) == []


@needs_fork
@pytest.mark.slow
def test_a_failed_launch_says_so():
    with pytest.raises(LaunchError, match=r"agent \d exited with 1") as caught:
        torchrun("false", no_python=True, nnodes=1, nproc_per_node=2)
    assert _tagged(caught.value.tag) == []


if __name__ == "__main__":
    _rank_main()
