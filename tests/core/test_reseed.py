"""A block over part of the sources, and ``Block.reseed``: a step keyed by its own seed."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from deterministic_ctx import (
    MisuseError,
    Snapshot,
    deterministic,
    isolated,
    register_rng,
    unregister_rng,
)
from deterministic_ctx.internal import Block, Settings, source_named
from tests.helpers import draw


def test_reseed_draws_what_a_block_of_that_seed_draws_and_keeps_the_flags():
    with deterministic(seed=7):
        expected = draw(), [torch.rand(2).tolist() for _ in range(2)]
    block = Block(Settings.build(0, False))
    block.start()
    try:
        assert torch.are_deterministic_algorithms_enabled()
        random.random()  # the stream moves on...
        block.reseed(7)  # ...and starts over from 7
        got = draw(), [torch.rand(2).tolist() for _ in range(2)]
        assert torch.are_deterministic_algorithms_enabled()  # the block's flags stay
    finally:
        block.stop()
    assert got == expected


def test_reseed_follows_the_blocks_rank():
    with deterministic(seed=5, rank=3):
        expected = draw()
    block = Block(Settings.build(0, False, 3))
    block.start()
    try:
        block.reseed(5)
        got = draw()
    finally:
        block.stop()
    assert got == expected


def test_the_callers_state_is_back_after_reseeding():
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    block = Block(None)
    block.start()
    try:
        for key in range(3):
            block.reseed(key)
            draw()
    finally:
        block.stop()
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


def test_reseed_only_on_the_innermost_open_block():
    outer = Block(None)
    with pytest.raises(MisuseError, match="innermost open block"):
        outer.reseed(1)  # not open
    outer.start()
    try:
        with deterministic(seed=0):
            state = torch.get_rng_state()
            with pytest.raises(MisuseError, match="innermost open block"):
                outer.reseed(1)  # a block entered after it is the live world
            assert torch.equal(torch.get_rng_state(), state)  # nothing was seeded
    finally:
        outer.stop()


def test_reseed_from_another_thread_is_refused():
    # The block is the lock holder's innermost, but not the calling thread's.
    block = Block(None)
    block.start()
    try:
        state = torch.get_rng_state()
        raised: list[BaseException] = []

        def other() -> None:
            try:
                block.reseed(1)
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(10)
        assert len(raised) == 1 and isinstance(raised[0], MisuseError)
        assert torch.equal(torch.get_rng_state(), state)  # nothing was seeded
    finally:
        block.stop()


def test_an_rng_registered_after_the_first_reseed_is_seeded_by_the_next():
    # The block keeps its reseeding plan from its first reseed; the registered
    # RNGs are read when each reseed runs, as a block's apply reads them.
    block = Block(None)
    block.start()
    try:
        block.reseed(4)
        late = register_rng(random.Random(0), key="registered-after-the-plan")
        try:
            block.reseed(4)
            got = late.random()
            with deterministic(seed=4):
                want = late.random()
        finally:
            unregister_rng(late)
    finally:
        block.stop()
    assert got == want


@pytest.mark.parametrize(
    ("seed", "error"), [(-1, ValueError), (2**32, ValueError), (1.0, TypeError), (True, TypeError)]
)
def test_reseed_checks_the_seed_before_seeding(seed, error):
    block = Block(None)
    block.start()
    try:
        state = torch.get_rng_state()
        with pytest.raises(error, match="seed"):
            block.reseed(seed)
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        block.stop()


def test_a_block_over_part_of_the_sources_captures_applies_and_restores_only_those():
    with isolated():  # the test seeds the caller's random and NumPy
        only_random = (source_named("random"),)
        np.random.seed(1)
        random.seed(1)
        block = Block(Settings.build(3, False), only_random)
        block.start()
        try:
            assert not torch.are_deterministic_algorithms_enabled()  # no flag source in it
            assert random.random() == random.Random(3).random()  # the random source was applied
            np.random.rand()  # NumPy is not the block's: its draw is kept
        finally:
            block.stop()
        assert random.random() == random.Random(1).random()  # restored
        second = np.random.RandomState(1)
        second.rand()
        assert np.random.rand() == second.rand()  # NumPy went on from the draw in the block


@pytest.mark.parametrize("rank", [None, 2])
@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_every_sources_reseeder_seeds_as_its_apply_does(seed, rank):
    # The law behind Block.reseed's fast path: a source's reseeder(seed, rank_seed)
    # leaves its generators where apply() of settings with that seed and flags=False
    # does (and a source that seeds nothing says so); with the fast paths off there
    # is no reseeder for the global generators, and apply runs.
    from deterministic_ctx import register_rng, unregister_rng
    from deterministic_ctx.sources import SOURCES
    from deterministic_ctx.sources._base import seeds_nothing

    settings = Settings.build(seed, False, rank, False)
    mine = register_rng(random.Random(1), key="reseeder-law", shared=False)
    try:
        with isolated():
            start = Snapshot.capture()
            for source in SOURCES:
                reseeder = source.reseeder()
                if reseeder is None or reseeder is seeds_nothing:
                    continue
                source.apply(settings)
                applied = draw(), mine.random()
                start.restore()
                reseeder(seed, settings.rank_seed)
                assert (draw(), mine.random()) == applied, source.name
                start.restore()
            for name in ("torch.flags", "environ", "torch.compile"):
                assert source_named(name).reseeder() is seeds_nothing
    finally:
        unregister_rng(mine)
