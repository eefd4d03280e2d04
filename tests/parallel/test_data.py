"""DataLoader workers and seeded generators, with real worker processes (fork and spawn)."""

from __future__ import annotations

import multiprocessing
import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, get_worker_info

import deterministic_ctx.parallel.data as data_module
import deterministic_ctx.parallel.ranks as distributed_module
from deterministic_ctx import MisuseError, derive_seed, deterministic, register_rng, unregister_rng
from deterministic_ctx.parallel.data import chain_worker_init, seed_worker, seeded_generator

needs_fork = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)
START_METHODS = [
    pytest.param("fork", marks=needs_fork),
    pytest.param("spawn", marks=pytest.mark.slow),
]

# Columns of a loaded row.
INDEX, WORKER, RANDOM, NUMPY, TORCH, USER = range(6)


class Augmenting(Dataset):
    """Every item draws once from ``random``, NumPy, torch and an optional user RNG."""

    def __init__(self, n: int = 8, rng: random.Random | None = None) -> None:
        self.n = n
        self.rng = rng

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        user = self.rng.random() if self.rng is not None else 0.0
        return torch.tensor(
            [
                i,
                -1 if info is None else info.id,
                random.random(),
                np.random.rand(),
                torch.rand(()).item(),
                user,
            ],
            dtype=torch.float64,
        )


def load(
    context: str | None,
    *,
    seed: int = 0,
    rank: int | str | None = None,
    dataset: Dataset | None = None,
    **loader_kwargs,
) -> torch.Tensor:
    """All rows of one pass over a 2-worker loader, inside a block."""
    loader_kwargs.setdefault("shuffle", True)
    with deterministic(seed=seed, rank=rank):
        loader = DataLoader(
            Augmenting() if dataset is None else dataset,
            batch_size=2,
            num_workers=0 if context is None else 2,
            multiprocessing_context=context,
            **loader_kwargs,
        )
        return torch.cat(list(loader))


def by_worker(rows: torch.Tensor, column: int) -> list[set[float]]:
    return [set(rows[rows[:, WORKER] == w][:, column].tolist()) for w in (0, 1)]


def assert_streams_disjoint(rows: torch.Tensor, columns: tuple[int, ...]) -> None:
    for column in columns:
        first, second = by_worker(rows, column)
        assert len(first) == len(second) == 4, column
        assert not first & second, f"workers share draws in column {column}"


@pytest.fixture
def user_rng():
    rng = register_rng(random.Random(123), key="augment")
    yield rng
    unregister_rng(rng)


# -- what a block gives a DataLoader by itself --------------------------------------------


@pytest.mark.parametrize("context", START_METHODS)
def test_a_block_alone_makes_workers_reproducible_and_distinct(context):
    first, second = load(context), load(context)
    assert torch.equal(first, second)
    assert sorted(first[:, INDEX].tolist()) == list(range(8))
    assert first[:, INDEX].tolist() != list(range(8))  # shuffled
    assert_streams_disjoint(first, (RANDOM, NUMPY, TORCH))


@needs_fork
def test_without_seed_worker_user_rngs_repeat_across_workers(user_rng):
    # The hole seed_worker closes: each worker holds a copy of the parent's RNG.
    rows = load("fork", dataset=Augmenting(rng=user_rng), shuffle=False)
    first, second = (rows[rows[:, WORKER] == w][:, USER].tolist() for w in (0, 1))
    assert first == second


# -- seed_worker ---------------------------------------------------------------------------


@pytest.mark.parametrize("context", START_METHODS)
def test_seed_worker_gives_every_rng_its_own_reproducible_stream(context, user_rng):
    def run(ctx):
        return load(ctx, dataset=Augmenting(rng=user_rng), worker_init_fn=seed_worker)

    first = run(context)
    assert torch.equal(first, run(context))
    assert_streams_disjoint(first, (RANDOM, NUMPY, TORCH, USER))
    if context == "spawn" and "fork" in multiprocessing.get_all_start_methods():
        # The registered RNG travelled with the dataset, the rank with the
        # function: spawned workers draw exactly what forked workers draw.
        assert torch.equal(first, run("fork"))


@needs_fork
def test_seed_worker_mixes_the_rank():
    runs = {r: load("fork", worker_init_fn=chain_worker_init(rank=r)) for r in (0, 1, 2)}
    for a, b in ((0, 1), (0, 2), (1, 2)):
        for column in (RANDOM, NUMPY, TORCH):
            assert not set(runs[a][:, column].tolist()) & set(runs[b][:, column].tolist())
    # Without a process group "auto" is rank 0, and None means rank 0.
    assert torch.equal(runs[0], load("fork", worker_init_fn=seed_worker))
    assert torch.equal(runs[0], load("fork", worker_init_fn=chain_worker_init(rank=None)))


def reseed_python(worker_id: int) -> None:
    random.seed(1000 + worker_id)


@needs_fork
def test_chain_worker_init_runs_the_users_function_last():
    rows = load("fork", worker_init_fn=chain_worker_init(reseed_python), shuffle=False)
    for worker in (0, 1):
        mine = rows[rows[:, WORKER] == worker][:, RANDOM].tolist()
        rng = random.Random(1000 + worker)
        assert mine == [rng.random() for _ in mine]
    seeded = load("fork", worker_init_fn=seed_worker, shuffle=False)
    assert torch.equal(rows[:, NUMPY], seeded[:, NUMPY])  # the rest is still seeded


def test_pickling_carries_the_parents_rank_and_registered_rngs(monkeypatch, user_rng):
    monkeypatch.setattr(distributed_module, "process_rank", lambda: 3)
    dataset = Augmenting(rng=user_rng)
    # spawn pickles the dataset and worker_init_fn in one stream, as here.
    worker_dataset, worker_init = pickle.loads(pickle.dumps((dataset, seed_worker)))
    assert worker_init._rank == 3
    assert worker_init._rngs == (("augment", worker_dataset.rng),)
    assert worker_init._rngs[0][1] is worker_dataset.rng
    chained = pickle.loads(pickle.dumps(chain_worker_init(reseed_python, rank=5)))
    assert (chained._fn, chained._rank) == (reseed_python, 5)
    assert repr(seed_worker) == "seed_worker"
    assert repr(chained).startswith("chain_worker_init(<function reseed_python")


class _FakeCudaGenerator(torch.Generator):
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def test_device_generators_stay_behind(monkeypatch, user_rng):
    # Unpickling a CUDA generator in a spawned worker would initialize CUDA there.
    monkeypatch.setattr(
        data_module,
        "registered_rngs",
        lambda: [("augment", user_rng), ("gpu", _FakeCudaGenerator())],
    )
    assert data_module.portable_rngs() == (("augment", user_rng),)


def test_seed_worker_outside_a_worker_says_where_it_belongs():
    with pytest.raises(MisuseError, match=r"worker_init_fn=seed_worker"):
        seed_worker(0)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"fn": 3}, TypeError, "fn must be a callable"),
        ({"rank": -1}, ValueError, "rank must be a non-negative int, 'auto' or None, got -1"),
        ({"rank": "first"}, ValueError, "rank must be .* got 'first'"),
        ({"rank": True}, TypeError, "rank must be .* got bool True"),
    ],
)
def test_chain_worker_init_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        chain_worker_init(**kwargs)


# -- seeded_generator -------------------------------------------------------------------


def test_seeded_generator_depends_only_on_its_arguments():
    assert seeded_generator(0).initial_seed() == derive_seed(0, "generator", "dataloader", bits=64)
    with deterministic(seed=0):
        a = torch.rand(3, generator=seeded_generator(0))
        torch.rand(100)
        b = torch.rand(3, generator=seeded_generator(0))
    assert torch.equal(a, b)
    assert torch.equal(a, torch.rand(3, generator=seeded_generator(0)))  # inside or outside
    assert seeded_generator(0, "train").initial_seed() != seeded_generator(0, "val").initial_seed()
    assert seeded_generator(0, 7).initial_seed() == derive_seed(0, "generator", 7, bits=64)
    assert seeded_generator(1).initial_seed() != seeded_generator(0).initial_seed()
    assert seeded_generator(0).device == torch.device("cpu")


def test_seeded_generator_per_rank():
    def seed_of(*args, **kwargs):
        return seeded_generator(*args, **kwargs).initial_seed()

    shared = seed_of(5)
    assert seed_of(5, rank=0) == seed_of(5, rank="auto") == shared  # no process group: rank 0
    assert len({shared, seed_of(5, rank=1), seed_of(5, rank=2)}) == 3
    assert seed_of(deterministic(seed=5, rank=2)) == seed_of(5, rank=2)
    assert seed_of(deterministic(seed=5)) == shared
    assert seed_of(deterministic(seed=5, rank=2), rank=1) == seed_of(5, rank=1)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((-1,), {}, ValueError, "seed must be in"),
        (("0",), {}, TypeError, "seed must be an int"),
        ((0, 1.5), {}, TypeError, "key must be a str or a non-negative int, got float"),
        ((0, -2), {}, TypeError, "key must be"),
        ((0,), {"rank": -1}, ValueError, "rank must be"),
    ],
)
def test_seeded_generator_rejects_bad_arguments(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        seeded_generator(*args, **kwargs)


def test_shuffle_order_with_a_seeded_generator_ignores_earlier_draws():
    def order(draws_before: int, generator: bool) -> list[int]:
        with deterministic(seed=3) as det:
            torch.rand(draws_before)
            g = seeded_generator(det) if generator else None
            return [int(i) for i in DataLoader(range(20), shuffle=True, generator=g)]

    assert order(0, True) == order(50, True)
    assert order(0, False) != order(50, False)  # without it, the order moves


@needs_fork
def test_seeded_generator_in_a_worker_loader():
    # The generator also draws each iterator's base seed, so worker streams
    # follow it too, whatever the block drew before.
    def run(draws_before: int) -> torch.Tensor:
        with deterministic(seed=0) as det:
            torch.rand(draws_before)
            loader = DataLoader(
                Augmenting(),
                batch_size=2,
                shuffle=True,
                num_workers=2,
                multiprocessing_context="fork",
                worker_init_fn=seed_worker,
                generator=seeded_generator(det),
            )
            return torch.cat(list(loader))

    assert torch.equal(run(0), run(10))


# -- DistributedSampler ----------------------------------------------------------------


def test_distributed_sampler_is_reproducible_under_a_block():
    def indices(rank: int, epoch: int, draws_before: int) -> list[int]:
        with deterministic(seed=9, rank=rank) as det:
            torch.rand(draws_before)
            sampler = DistributedSampler(range(10), num_replicas=2, rank=rank, seed=det.seed)
            sampler.set_epoch(epoch)
            return list(sampler)

    for epoch in (0, 1):
        zero, one = indices(0, epoch, 0), indices(1, epoch, 0)
        assert zero == indices(0, epoch, 30)
        assert not set(zero) & set(one)
        assert sorted(zero + one) == list(range(10))
    assert indices(0, 0, 0) != indices(0, 1, 0)
