"""What the trainers' callbacks share: the steps' keys and the block around training that each
step reseeds (``deterministic_ctx.integrations.trainer_steps``)."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from deterministic_ctx import MisuseError, SeededDataset, deterministic, isolated
from deterministic_ctx.integrations.trainer_steps import CHUNK, StepKeys, TrainingBlock
from tests.helpers import draw


def test_a_steps_key_is_the_keyed_streams_item_seed_across_chunks_and_epochs():
    keys = StepKeys(11)
    stream = SeededDataset(list(range(3)), seed=11)
    # In order, across chunk boundaries, backwards (a resumed epoch), from the middle of an
    # epoch, and from one epoch to another and back.
    order = [0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 5, 3, 700, 699, 0]
    for epoch in (0, 2, 0):
        for index in order:
            assert keys.key(epoch, index) == stream.item_seed(index, epoch=epoch)
    assert len({keys.key(0, i) for i in range(500)}) == 500  # distinct steps, distinct keys


def test_each_step_draws_what_a_block_of_its_key_draws_whatever_ran_before():
    training = TrainingBlock(5, owner="the test")
    keys = StepKeys(5)  # not the block's keys: those derive from derive_seed(5, "step")
    training.start()
    try:
        training.step(1, 4)
        first = draw(), torch.rand(3)
        draw()  # the stream moves on (a validation loop between steps, say)
        training.step(1, 4)
        again = draw(), torch.rand(3)
        training.step(1, 5)
        other = draw()
        assert torch.are_deterministic_algorithms_enabled()  # the block's flags stay on
    finally:
        training.close()
    assert first[0] == again[0] and torch.equal(first[1], again[1])
    assert other != first[0]
    expected_key = training._keys.key(1, 4)
    assert expected_key != keys.key(1, 4)
    with deterministic(seed=expected_key, flags=False):
        assert draw() == first[0]


def test_the_callers_state_and_flags_are_back_after_close():
    with isolated():
        random.seed(3)
        np.random.seed(3)
        torch.manual_seed(3)
        before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
        training = TrainingBlock(0, owner="the test")
        for step in range(3):  # opened by the first step
            training.step(0, step)
            draw()
        assert training.is_open
        training.close()
        training.close()  # idempotent
        assert not training.is_open
        assert random.getstate() == before[0]
        assert np.array_equal(np.random.get_state()[1], before[1])
        assert torch.equal(torch.get_rng_state(), before[2])
        assert not torch.are_deterministic_algorithms_enabled()


def test_a_block_left_open_above_it_is_named_and_nothing_is_seeded():
    training = TrainingBlock(0, owner="SomeCallback")
    training.start()
    try:
        left_open = deterministic(seed=1).start()
        try:
            state = torch.get_rng_state()
            with pytest.raises(MisuseError, match="SomeCallback seeds each training step"):
                training.step(0, 0)
            assert torch.equal(torch.get_rng_state(), state)
        finally:
            left_open.stop()
    finally:
        training.close()


def test_a_copy_does_not_own_the_open_block():
    training = TrainingBlock(2, owner="the test")
    training.start()
    try:
        copy = pickle.loads(pickle.dumps(training))
        assert not copy.is_open
        assert copy._keys.key(0, 3) == training._keys.key(0, 3)
    finally:
        training.close()


def test_bad_settings_are_refused_when_it_is_made():
    with pytest.raises(TypeError, match="warn_only"):
        TrainingBlock(0, owner="the test", warn_only=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        TrainingBlock(-1, owner="the test")
