"""Per-sample keyed randomness: SeededDataset and SeededSampler, with real worker processes.

An item's numbers must depend on (seed, epoch, index) only: not on workers, their start
method, persistence or prefetching, the caller's random state, or the rank that draws it.
"""

from __future__ import annotations

import multiprocessing
import pickle
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset, SequentialSampler

from deterministic_ctx import (
    SeededDataset,
    SeededIndex,
    SeededSampler,
    deterministic,
    register_rng,
    unregister_rng,
)

needs_fork = pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method"
)

# Three workers on a two-core machine: what the invariance is about, not a mistake.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

N = 12
BATCH = 2


class Augmenting(Dataset):
    """Each item draws from ``random``, NumPy's global RNG, torch and a user RNG."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        user = self.rng.random() if self.rng is not None else 0.0
        return torch.tensor(
            [i, random.random(), np.random.rand(), torch.rand(()).item(), np.random.randn(), user],
            dtype=torch.float64,
        )


@pytest.fixture
def user_rng() -> Iterator[random.Random]:
    rng = register_rng(random.Random(99), key="keyed-test")
    try:
        yield rng
    finally:
        unregister_rng(rng)


def items(
    dataset: Dataset,
    epochs: tuple[int, ...] = (0,),
    *,
    num_replicas: int = 1,
    rank: int = 0,
    **loader_kwargs,
) -> dict[tuple[int, int], tuple[float, ...]]:
    """``{(epoch, index): item}`` over ``epochs`` on one rank (one loader, reused)."""
    sampler = SeededSampler(dataset, seed=7, num_replicas=num_replicas, rank=rank)
    # Its own generator: iter(loader) would draw the workers' base seed from torch's global one.
    loader = DataLoader(
        dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator(), **loader_kwargs
    )
    out = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for batch in loader:
            for row in batch:
                out[(epoch, int(row[0]))] = tuple(row.tolist())
    return out


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, int], tuple[float, ...]]:
    """Epochs 0 and 1 on one rank, in this process, with a user RNG registered."""
    rng = register_rng(random.Random(99), key="keyed-test")
    try:
        return items(SeededDataset(Augmenting(rng), seed=3), (0, 1))
    finally:
        unregister_rng(rng)


def test_epochs_differ_and_every_source_is_keyed(reference):
    assert len(reference) == 2 * N
    for i in range(N):
        a, b = reference[(0, i)], reference[(1, i)]
        assert all(x != y for x, y in zip(a[1:], b[1:], strict=True)), (i, a, b)
    # Different samples draw differently too (the keys are mixed, not seed + i).
    draws = {row[1] for row in reference.values()}
    assert len(draws) == 2 * N


@needs_fork
@pytest.mark.parametrize(
    "loader_kwargs",
    [
        {"num_workers": 1},
        {"num_workers": 3},
        {"num_workers": 3, "persistent_workers": True},
        {"num_workers": 3, "prefetch_factor": 1},
        {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4},
    ],
    ids=["1", "3", "3-persistent", "3-prefetch1", "2-persistent-prefetch4"],
)
def test_items_do_not_depend_on_workers(reference, user_rng, loader_kwargs):
    dataset = SeededDataset(Augmenting(user_rng), seed=3)
    assert items(dataset, (0, 1), multiprocessing_context="fork", **loader_kwargs) == reference


def test_items_do_not_depend_on_workers_spawn(reference, user_rng):
    # A spawned worker is a fresh interpreter: the epoch comes with each index, and the
    # registered RNG travels with the dataset (the worker registers the copy it unpickled).
    dataset = SeededDataset(Augmenting(user_rng), seed=3)
    got = items(
        dataset, (0, 1), num_workers=2, multiprocessing_context="spawn", persistent_workers=True
    )
    assert got == reference


def test_items_do_not_depend_on_the_callers_state_and_leave_it_alone(reference, user_rng):
    dataset = SeededDataset(Augmenting(user_rng), seed=3)
    for seed in (0, 1):
        with deterministic(seed=seed, flags=False):
            _ = random.random(), np.random.randn(), torch.rand(3), user_rng.random()
            before = (
                random.getstate(),
                np.random.get_state(legacy=False),
                torch.get_rng_state(),
                user_rng.getstate(),
            )
            got = items(dataset, (0, 1))
            after = (
                random.getstate(),
                np.random.get_state(legacy=False),
                torch.get_rng_state(),
                user_rng.getstate(),
            )
        assert got == reference
        assert before[0] == after[0]
        assert str(before[1]) == str(after[1])  # has_gauss and gauss included
        assert torch.equal(before[2], after[2])
        assert before[3] == after[3]


@needs_fork
@pytest.mark.parametrize("world", [2, 4])
def test_each_sample_is_the_same_on_any_rank(reference, user_rng, world):
    dataset = SeededDataset(Augmenting(user_rng), seed=3)
    merged: dict[tuple[int, int], tuple[float, ...]] = {}
    for rank in range(world):
        got = items(
            dataset,
            (0, 1),
            num_replicas=world,
            rank=rank,
            num_workers=rank % 2,  # workers on some ranks only: it must not matter
            multiprocessing_context="fork" if rank % 2 else None,
        )
        for key, value in got.items():
            assert merged.setdefault(key, value) == value  # padding repeats a sample: alike
    assert merged == reference


def test_an_item_draws_what_a_block_seeded_with_its_key_draws(user_rng):
    inner = Augmenting(user_rng)
    dataset = SeededDataset(inner, seed=11)
    for epoch, index in [(0, 0), (0, 5), (3, 5), (2**40, N - 1)]:
        key = dataset.item_seed(index, epoch)
        with deterministic(seed=key, flags=False):
            expected = inner[index]
        assert torch.equal(dataset[SeededIndex(index, epoch)], expected)


def test_keys_are_mixed_not_offsets():
    data = SeededDataset(list(range(100)), seed=0)
    keys = {data.item_seed(i, e) for i in range(100) for e in range(10)}
    assert len(keys) == 1000
    shifted = SeededDataset(list(range(100)), seed=1)
    assert data.item_seed(1, 0) != shifted.item_seed(0, 0)
    assert data.item_seed(0, 1) != data.item_seed(1, 0)
    assert all(0 <= k < 2**32 for k in keys)


def test_plain_indices_use_the_datasets_epoch(user_rng):
    dataset = SeededDataset(Augmenting(user_rng), seed=3)
    loader = DataLoader(
        dataset, batch_size=BATCH, sampler=SequentialSampler(dataset), generator=torch.Generator()
    )
    first = torch.cat(list(loader))
    assert torch.equal(first[5], dataset[SeededIndex(5, 0)])
    assert torch.equal(dataset[-1], dataset[N - 1])
    assert torch.equal(dataset[np.int64(4)], dataset[4])
    dataset.set_epoch(2)
    second = torch.cat(list(loader))
    assert torch.equal(second[5], dataset[SeededIndex(5, 2)])
    assert not torch.equal(first[5], second[5])


class Failing(Dataset):
    def __getitem__(self, i: int) -> float:
        random.random()
        np.random.randn()
        torch.rand(2)
        raise KeyError(i)


def test_an_item_that_raises_still_restores_every_stream():
    dataset = SeededDataset(Failing(), seed=0)
    with deterministic(seed=1, flags=False):
        np.random.randn()  # a cached gaussian, which must survive
        before = (random.getstate(), str(np.random.get_state()), torch.get_rng_state())
        with pytest.raises(KeyError):
            dataset[3]
        after = (random.getstate(), str(np.random.get_state()), torch.get_rng_state())
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])


def test_another_numpy_bit_generator_is_put_back():
    inner = Augmenting()
    dataset = SeededDataset(inner, seed=0)
    with deterministic(seed=0, flags=False):
        pcg = np.random.PCG64(5)
        np.random.set_bit_generator(pcg)
        with deterministic(seed=dataset.item_seed(2), flags=False):
            expected = inner[2]
        got = dataset[2]
        assert np.random.get_bit_generator() is pcg
        assert pcg.state == np.random.PCG64(5).state
    assert torch.equal(got, expected)


def test_seeded_index_pickles_with_its_epoch():
    index = SeededIndex(7, epoch=3)
    copy = pickle.loads(pickle.dumps(index))
    assert type(copy) is SeededIndex and copy == 7 and copy.epoch == 3
    assert type(index + 1) is int


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-1, 0), ValueError, "index must be a non-negative int, got -1"),
        ((1, True), TypeError, "epoch must be a non-negative int, got bool True"),
        ((1.0, 0), TypeError, "index must be a non-negative int, got float 1.0"),
    ],
)
def test_seeded_index_rejects_bad_input(args, error, message):
    with pytest.raises(error, match=message):
        SeededIndex(*args)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_seeded_dataset_rejects_bad_input():
    with pytest.raises(TypeError, match="dataset must be a map-style dataset"):
        SeededDataset(Stream(), seed=0)
    with pytest.raises(ValueError, match=r"seed must be in 0 \.\. 4294967295"):
        SeededDataset([1], seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        SeededDataset([1], seed="0")  # type: ignore[arg-type]
    data = SeededDataset([1, 2], seed=0)
    with pytest.raises(TypeError, match="index must be an int"):
        data[0:1]  # type: ignore[index]
    with pytest.raises(TypeError, match=r"index must be an int \(one sample; .*\), got bool True"):
        data[True]
    with pytest.raises(IndexError, match="index -3 is out of range for a dataset of 2 items"):
        data[-3]
    with pytest.raises(ValueError, match="epoch must be a non-negative int, got -1"):
        data.set_epoch(-1)
    assert data.epoch == 0


# -- the sampler ---------------------------------------------------------------------------


def test_the_order_is_a_function_of_seed_and_epoch():
    a = SeededSampler(range(50), seed=0)
    b = SeededSampler(range(50), seed=0)
    with deterministic(seed=0):  # the global stream plays no part
        torch.rand(10)
        first = list(a)
    assert first == list(b) and sorted(first) == list(range(50))
    assert first != list(SeededSampler(range(50), seed=1))
    a.set_epoch(1)
    assert list(a) != first
    assert list(SeededSampler(range(5), seed=0, shuffle=False)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("drop_last", "per_rank"), [(False, 3), (True, 2)])
def test_ranks_split_the_epoch_like_distributed_sampler(drop_last, per_rank):
    ranks = [
        list(SeededSampler(range(10), seed=0, num_replicas=4, rank=r, drop_last=drop_last))
        for r in range(4)
    ]
    order = list(SeededSampler(range(10), seed=0))
    assert all(len(r) == per_rank for r in ranks)
    merged = [ranks[r][j] for j in range(per_rank) for r in range(4)]
    expected = order[:8] if drop_last else order + order[:2]
    assert merged == expected


def test_defaults_come_from_the_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    sampler = SeededSampler(range(10), seed=0)
    assert (sampler.num_replicas, sampler.rank) == (4, 2)
    assert (SeededSampler(range(10), seed=0, rank=1).rank) == 1
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert (SeededSampler(range(10), seed=0).num_replicas) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"seed": 2**32}, ValueError, "seed must be in 0 .. 4294967295"),
        ({"seed": 0, "shuffle": 1}, TypeError, "shuffle must be True or False, got 1"),
        ({"seed": 0, "drop_last": None}, TypeError, "drop_last must be True or False"),
        ({"seed": 0, "num_replicas": 0}, ValueError, "num_replicas must be a positive int"),
        ({"seed": 0, "num_replicas": 2, "rank": 2}, ValueError, r"rank must be in 0 .. .* = 1"),
        ({"seed": 0, "rank": -1}, ValueError, "rank must be a non-negative int, got -1"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        SeededSampler(range(4), **kwargs)


def test_sampler_needs_a_length():
    with pytest.raises(TypeError, match="data_source must have a len"):
        SeededSampler(Stream(), seed=0)


def _state(**changes):
    state = {"seed": 0, "epoch": 1, "consumed": 3, "size": 10, "shuffle": True}
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (_state(seed=1), r'state_dict\["seed"\] is 1, but this sampler\'s seed is 0'),
        (_state(size=11), r'state_dict\["size"\] is 11, but this sampler\'s size is 10'),
        (_state(shuffle=False), r'state_dict\["shuffle"\] is False'),
        (_state(consumed=11), "more than the 10 indices of an epoch"),
        (_state(epoch=-1), r'state_dict\["epoch"\] must be a non-negative int'),
        (_state(epoch="1"), r'state_dict\["epoch"\] must be a non-negative int, got str'),
        ({"seed": 0}, "must have exactly the keys"),
    ],
)
def test_load_state_dict_rejects_what_does_not_fit_and_changes_nothing(state, message):
    sampler = SeededSampler(range(10), seed=0)
    sampler.set_epoch(4)
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict(state)
    assert sampler.epoch == 4 and len(sampler) == 10


def test_consumed_cannot_exceed_what_the_pass_handed_out():
    sampler = SeededSampler(range(10), seed=0)
    it = iter(sampler)
    next(it)
    with pytest.raises(ValueError, match=r"consumed must be in 0 \.\. 1 .*, got 2"):
        sampler.state_dict(consumed=2)
    assert sampler.state_dict(consumed=0)["consumed"] == 0
    assert sampler.state_dict()["consumed"] == 1


@pytest.mark.parametrize("consumed", [5, 9, 10, 11, 999])
def test_every_consumed_beyond_the_handed_out_indices_is_refused_alike(consumed):
    # Once, 10 and 999 were clamped to the epoch's end: the rest of the epoch skipped, silently.
    sampler = SeededSampler(range(10), seed=0)
    it = iter(sampler)
    for _ in range(4):
        next(it)
    message = rf"^consumed must be in 0 \.\. 4 \(the indices this pass has handed out so far\), got {consumed}$"
    with pytest.raises(ValueError, match=message):
        sampler.state_dict(consumed=consumed)
    assert sampler.state_dict(consumed=4)["consumed"] == 4  # all it handed out


def test_consumed_before_any_pass_can_only_be_zero():
    sampler = SeededSampler(range(10), seed=0)
    with pytest.raises(ValueError, match=r"consumed must be in 0 \.\. 0 .*, got 1$"):
        sampler.state_dict(consumed=1)
    assert sampler.state_dict(consumed=0)["consumed"] == 0
    sampler.load_state_dict(_state(epoch=2, consumed=4))  # loaded: the next pass has not begun
    with pytest.raises(ValueError, match=r"consumed must be in 0 \.\. 0 .*, got 6$"):
        sampler.state_dict(consumed=6)
    assert sampler.state_dict(consumed=0) == _state(epoch=2, consumed=4)
    list(sampler)  # a whole pass: all of it may be consumed, no more
    assert sampler.state_dict(consumed=6)["consumed"] == 10
    with pytest.raises(ValueError, match=r"consumed must be in 0 \.\. 6 .*, got 7$"):
        sampler.state_dict(consumed=7)


# -- an epoch's end is a resume point ------------------------------------------------------


def _finished(epoch: int = 1, **kwargs) -> dict:
    """The state of a sampler that handed out the last index of ``epoch``."""
    sampler = SeededSampler(range(10), seed=0, **kwargs)
    sampler.set_epoch(epoch)
    list(sampler)
    state = sampler.state_dict()
    assert state["epoch"] == epoch
    return state


def _order(epoch: int) -> list[int]:
    sampler = SeededSampler(range(10), seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_a_finished_epoch_loaded_after_set_epoch_of_the_next_starts_the_next():
    # What StatefulDataLoader does under a trainer: set_epoch(e + 1), then (lazily, in
    # __iter__) the state saved on epoch e's last batch.  It once yielded nothing.
    sampler = SeededSampler(range(10), seed=0)
    sampler.set_epoch(2)
    sampler.load_state_dict(_finished(1))
    indices = list(sampler)
    assert indices == _order(2) and {i.epoch for i in indices} == {2}


@pytest.mark.parametrize("then", [None, 2])
def test_a_finished_epoch_loaded_first_starts_the_next(then):
    sampler = SeededSampler(range(10), seed=0)
    sampler.load_state_dict(_finished(1))
    assert sampler.epoch == 2 and len(sampler) == 10
    if then is not None:
        sampler.set_epoch(then)
    assert list(sampler) == _order(2)
    assert sampler.state_dict() == _state(epoch=2, consumed=10)


@pytest.mark.parametrize("set_first", [False, True])
def test_a_loop_that_asks_again_for_the_finished_epoch_gets_its_empty_rest(set_first):
    # The plain loop of the docs saves `epoch` with the state and calls set_epoch(epoch).
    sampler = SeededSampler(range(10), seed=0)
    if set_first:
        sampler.set_epoch(1)
    sampler.load_state_dict(_finished(1))
    sampler.set_epoch(1)
    assert len(sampler) == 0 and list(sampler) == []
    sampler.set_epoch(2)
    assert list(sampler) == _order(2)


def test_state_dict_and_len_agree_with_a_loaded_finished_epoch():
    state = _finished(1)
    sampler = SeededSampler(range(10), seed=0)
    sampler.load_state_dict(state)
    assert sampler.state_dict() == state  # saved again before a pass: the same resume point
    again = SeededSampler(range(10), seed=0)
    again.load_state_dict(sampler.state_dict())
    assert list(again) == _order(2)
    sampler.set_epoch(1)
    assert (len(sampler), sampler.state_dict()) == (0, state)
    sampler.set_epoch(2)
    assert (len(sampler), sampler.state_dict()) == (10, _state(epoch=2, consumed=0))


def test_an_epoch_cut_to_the_ranks_is_finished_when_fewer_than_the_ranks_remain():
    state = _finished(1, num_replicas=3, rank=0, drop_last=True)
    assert state["consumed"] == 9
    sampler = SeededSampler(range(10), seed=0, num_replicas=3, rank=1, drop_last=True)
    sampler.load_state_dict(state)
    assert sampler.epoch == 2 and len(sampler) == 3


def test_a_state_short_of_the_end_keeps_its_epoch():
    sampler = SeededSampler(range(10), seed=0)
    sampler.set_epoch(2)
    sampler.load_state_dict(_state(epoch=1, consumed=9))
    assert sampler.epoch == 1 and list(sampler) == _order(1)[9:]


def test_set_epoch_after_a_load_keeps_the_position_only_for_the_loaded_epoch():
    sampler = SeededSampler(range(10), seed=0)
    sampler.load_state_dict(_state(epoch=2, consumed=4))
    sampler.set_epoch(2)
    assert len(sampler) == 6 and sampler.state_dict()["consumed"] == 4
    sampler.set_epoch(3)
    assert len(sampler) == 10 and sampler.state_dict() == _state(epoch=3, consumed=0)


# -- resuming mid-epoch with a plain DataLoader --------------------------------------------


def _epoch_rows(loader: DataLoader, sampler: SeededSampler, epoch: int) -> list[tuple]:
    sampler.set_epoch(epoch)
    return [tuple(row.tolist()) for batch in loader for row in batch]


@needs_fork
@pytest.mark.parametrize(("workers_before", "workers_after"), [(2, 0), (0, 3)])
def test_plain_dataloader_resumes_mid_epoch_with_other_workers(
    user_rng, workers_before, workers_after
):
    dataset = SeededDataset(Augmenting(user_rng), seed=3)

    def loader(sampler: SeededSampler, workers: int) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=BATCH,
            sampler=sampler,
            num_workers=workers,
            multiprocessing_context="fork" if workers else None,
            generator=torch.Generator(),
        )

    whole = SeededSampler(dataset, seed=5)
    expected = _epoch_rows(loader(whole, 0), whole, 1)

    first = SeededSampler(dataset, seed=5)
    first.set_epoch(1)
    taken = []
    for i, batch in enumerate(loader(first, workers_before)):
        taken += [tuple(row.tolist()) for row in batch]
        if i == 2:  # the workers have prefetched more than these three batches
            state = first.state_dict(consumed=(i + 1) * BATCH)
            break
    assert state["consumed"] == 3 * BATCH

    resumed = SeededSampler(dataset, seed=5)
    resumed.load_state_dict(state)
    rest = _epoch_rows(loader(resumed, workers_after), resumed, 1)
    assert taken + rest == expected
    assert _epoch_rows(loader(resumed, 0), resumed, 2) == _epoch_rows(loader(whole, 0), whole, 2)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 1), (3, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_another_world_size_covers_the_rest_of_the_epoch_once(user_rng, before, after, drop_last):
    dataset = SeededDataset(Augmenting(user_rng), seed=3)
    reference = {i: dataset[SeededIndex(i, 1)] for i in range(N)}

    def sampler(world: int, rank: int) -> SeededSampler:
        s = SeededSampler(dataset, seed=5, num_replicas=world, rank=rank, drop_last=drop_last)
        s.set_epoch(1)
        return s

    steps = 1  # batches per rank before the stop
    old = [sampler(before, r) for r in range(before)]
    consumed: list[int] = []
    for s in old:
        it = iter(DataLoader(dataset, batch_size=BATCH, sampler=s, generator=torch.Generator()))
        for _ in range(steps):
            consumed += [int(row[0]) for row in next(it)]
    states = [s.state_dict(consumed=steps * BATCH) for s in old]
    assert all(state == states[0] for state in states)

    rest: list[int] = []
    for r in range(after):
        s = sampler(after, r)
        s.load_state_dict(states[r % before])
        for batch in DataLoader(dataset, batch_size=BATCH, sampler=s, generator=torch.Generator()):
            for row in batch:
                index = int(row[0])
                assert torch.equal(row, reference[index])  # its own augmentation, on any rank
                rest.append(index)

    order = list(sampler(1, 0))
    gone = before * steps * BATCH
    assert sorted(consumed) == sorted(order[:gone])
    remaining = order[gone:]
    if drop_last:
        kept = len(remaining) // after * after
        assert sorted(rest) == sorted(remaining[:kept])
    else:
        assert sorted(rest) == sorted(remaining + order[: len(rest) - len(remaining)])


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(0, 40),
    before=st.integers(1, 5),
    after=st.integers(1, 5),
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    data=st.data(),
)
def test_a_resume_on_any_world_takes_each_remaining_index_once(
    size, before, after, drop_last, shuffle, data
):
    # The law behind the world-size policy, for any size, worlds and stop: what the old
    # ranks took, then what the new ranks take, is the epoch's order (then the padding).
    def ranks(world: int) -> list[SeededSampler]:
        out = []
        for rank in range(world):
            s = SeededSampler(
                range(size),
                seed=9,
                shuffle=shuffle,
                num_replicas=world,
                rank=rank,
                drop_last=drop_last,
            )
            s.set_epoch(2)
            out.append(s)
        return out

    order = [int(i) for i in ranks(1)[0]]
    old = ranks(before)
    iterators = [iter(s) for s in old]
    steps = data.draw(st.integers(0, len(old[0])), label="indices each old rank took")
    taken = [[int(next(it)) for _ in range(steps)] for it in iterators]
    states = [s.state_dict() for s in old]
    assert all(state == states[0] for state in states)
    gone = min(before * steps, size)
    assert sorted({i for t in taken for i in t}) == sorted(set(order[:gone]))

    new = ranks(after)
    for s in new:
        s.load_state_dict(states[0])
    rest = [[int(i) for i in s] for s in new]
    assert len({len(r) for r in rest}) <= 1  # every new rank takes as many
    merged = [r[j] for j in range(len(rest[0])) for r in rest]
    remaining = order[gone:]
    if drop_last:
        assert merged == remaining[: len(remaining) // after * after]
    else:
        pad = len(merged) - len(remaining)
        assert 0 <= pad < after
        assert merged == remaining + (order * after)[:pad]


def test_wrapping_the_outermost_dataset_keeps_the_epoch():
    parts = torch.utils.data.ConcatDataset([Augmenting(), Augmenting()])
    outer = SeededDataset(parts, seed=3)
    a, b = outer[SeededIndex(N + 1, 0)], outer[SeededIndex(N + 1, 1)]
    assert a[0] == b[0] == 1  # the second part's item 1
    assert not torch.equal(a, b)  # each epoch its own draws
    # The other way round, ConcatDataset's index arithmetic drops the epoch (documented).
    inner = torch.utils.data.ConcatDataset([SeededDataset(Augmenting(), seed=3)] * 2)
    assert torch.equal(inner[SeededIndex(N + 1, 0)], inner[SeededIndex(N + 1, 1)])


# -- batches: __getitems__ -----------------------------------------------------------------


class Dirty(Dataset):
    """Draws from every source and leaves each one's cache set: Python's ``gauss_next``,
    NumPy's legacy gaussian, torch's normal sample; and from registered RNGs."""

    def __init__(self, rngs: tuple[object, ...] = ()) -> None:
        self.rngs = rngs

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        values = [float(i), random.random(), random.gauss(0.0, 1.0), np.random.rand()]
        values += [np.random.randn(), torch.rand(()).item(), torch.randn(()).item()]
        for rng in self.rngs:
            if isinstance(rng, torch.Generator):
                values.append(torch.randn((), generator=rng).item())
            elif isinstance(rng, np.random.Generator):
                values.append(float(rng.integers(0, 2**32, dtype=np.uint32)))  # half a word left
            else:
                values.append(rng.random())  # type: ignore[attr-defined]
        return torch.tensor(values, dtype=torch.float64)


@pytest.fixture
def user_rngs() -> Iterator[tuple[object, ...]]:
    made = (
        random.Random(1),
        np.random.default_rng(2),
        np.random.RandomState(3),
        torch.Generator().manual_seed(4),
    )
    rngs = tuple(register_rng(r, key=f"keyed-batch{k}") for k, r in enumerate(made))
    try:
        yield rngs
    finally:
        for rng in rngs:
            unregister_rng(rng)


def _rng_state(rng: object) -> str:
    if isinstance(rng, np.random.Generator):
        return str(rng.bit_generator.state)
    if isinstance(rng, torch.Generator):
        return str(rng.get_state().tolist())
    return str(rng.get_state() if isinstance(rng, np.random.RandomState) else rng.getstate())  # type: ignore[attr-defined]


def _world() -> tuple[object, ...]:
    return (
        random.getstate(),
        str(np.random.get_state(legacy=False)),
        torch.get_rng_state().tolist(),
    )


@settings(max_examples=40, deadline=None)
@given(
    indices=st.lists(
        st.tuples(st.integers(0, N - 1), st.one_of(st.none(), st.integers(0, 3))), max_size=9
    )
)
def test_a_batch_gives_the_items_one_by_one_gives(indices):
    # The state is captured once per batch and each item seeded afresh: bit for bit the
    # same as one __getitem__ per index, whatever mix of epochs and plain ints.
    rngs = (random.Random(5), np.random.default_rng(6), torch.Generator())
    registered = [register_rng(r, key=f"keyed-hyp{k}") for k, r in enumerate(rngs)]
    try:
        dataset = SeededDataset(Dirty(rngs), seed=3)
        dataset.set_epoch(2)
        batch = [i if epoch is None else SeededIndex(i, epoch) for i, epoch in indices]
        with deterministic(seed=1, flags=False):
            random.gauss(0.0, 1.0)  # every gaussian cache set
            np.random.randn()
            torch.randn(())
            before = _world()
            got = dataset.__getitems__(batch)
            assert _world() == before
            expected = [dataset[index] for index in batch]
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    finally:
        for rng in registered:
            unregister_rng(rng)


def test_a_batch_with_registered_rngs_of_every_kind(user_rngs):
    dataset = SeededDataset(Dirty(user_rngs), seed=3)
    batch = [SeededIndex(i, 1) for i in (4, 0, 4, 11, 7)]
    with deterministic(seed=0, flags=False):  # the draws below leave the test's state alone
        for rng in user_rngs:  # leave each one mid-stream
            Dirty((rng,))[0]
        states = [_rng_state(rng) for rng in user_rngs]
        got = dataset.__getitems__(batch)
        assert [_rng_state(rng) for rng in user_rngs] == states
        for index, row in zip(batch, got, strict=True):
            assert torch.equal(row, dataset[index])
            with deterministic(seed=dataset.item_seed(int(index), 1), flags=False):
                assert torch.equal(row, dataset.dataset[int(index)])  # what a block gives


class Raising(Dataset):
    def __getitem__(self, i: int) -> float:
        random.random()
        np.random.randn()
        torch.rand(2)
        if i == 3:
            raise KeyError(i)
        return float(i)


def test_an_item_that_raises_in_a_batch_still_restores_every_stream():
    dataset = SeededDataset(Raising(), seed=0)
    with deterministic(seed=1, flags=False):
        np.random.randn()  # a cached gaussian, which must survive
        before = _world()
        with pytest.raises(KeyError):
            dataset.__getitems__([1, 2, 3, 4])
        assert _world() == before


class Batched(Augmenting):
    """A dataset with a batched fetch of its own, which a keyed batch must not call."""

    def __getitems__(self, indices):  # pragma: no cover - must not run
        raise AssertionError("the wrapped dataset's __getitems__ was called")


class Counting(SeededDataset):
    calls = 0

    def __getitems__(self, indices):
        Counting.calls += 1
        return super().__getitems__(indices)


def test_a_loader_fetches_a_batch_at_once_and_never_the_wrapped_batch(reference, user_rng):
    Counting.calls = 0
    dataset = Counting(Batched(user_rng), seed=3)
    assert items(dataset, (0, 1)) == reference
    assert Counting.calls == 2 * N // BATCH


class Installs(Dataset):
    """Item 2 installs a bit generator of its own in NumPy's global RNG."""

    def __getitem__(self, i: int) -> float:
        if i == 2:
            np.random.set_bit_generator(np.random.PCG64(i))
        return float(np.random.rand())


def test_an_item_that_replaces_numpy_s_bit_generator_in_a_batch():
    dataset = SeededDataset(Installs(), seed=0)
    with deterministic(seed=0, flags=False):
        mine = np.random.get_bit_generator()
        state = str(mine.state)
        expected = [dataset[i] for i in (1, 2, 3, 4)]
        assert np.random.get_bit_generator() is mine
        assert dataset.__getitems__([1, 2, 3, 4]) == expected
        assert np.random.get_bit_generator() is mine and str(mine.state) == state


def test_the_sampler_s_indices_pickle_as_seeded_indices():
    indices = list(SeededSampler(range(6), seed=0, shuffle=False))
    copies = pickle.loads(pickle.dumps(indices))
    assert [type(i) for i in copies] == [SeededIndex] * 6
    assert [(int(i), i.epoch) for i in copies] == [(i, 0) for i in range(6)]
    assert repr(copies[2]) == "SeededIndex(2, epoch=0)"
