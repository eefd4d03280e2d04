"""isolated(): capture and restore everything a block does, apply nothing."""

from __future__ import annotations

import asyncio
import os
import random
import unittest

import numpy as np
import pytest
import torch

from deterministic_ctx import Snapshot, deterministic, isolated, register_rng, unregister_rng
from tests._oracle import World
from tests.helpers import draw


@pytest.fixture(autouse=True)
def _put_back():
    # These tests seed the process's own streams on purpose (to know what the
    # caller draws next): put them back for the suite's leak guard.
    snap = Snapshot.capture()
    yield
    snap.restore()


def test_the_block_draws_the_callers_numbers_and_the_stream_comes_back():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expected = draw()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    with isolated():
        inside = draw()
    assert inside == expected  # nothing was seeded: the caller's own next numbers
    assert draw() == expected  # and the caller's streams are as before the block


def test_nothing_is_applied_and_everything_changed_is_put_back(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    before = World.now()
    with isolated():
        # A deterministic block would have set these: isolated() leaves the caller's.
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert "PYTHONHASHSEED" not in os.environ
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = True
        os.environ["PL_GLOBAL_SEED"] = "3"
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(99)
    assert World.now() == before
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.benchmark
    assert "PL_GLOBAL_SEED" not in os.environ
    assert torch.get_default_dtype() == torch.float32


def test_an_exception_still_restores_and_propagates():
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="body"), isolated():
        torch.rand(3)
        raise ValueError("body")
    assert torch.equal(torch.get_rng_state(), state)


def test_inside_a_deterministic_block_it_continues_the_blocks_stream():
    with deterministic(seed=3):
        first = draw()
    with deterministic(seed=3):
        with isolated():
            assert draw() == first  # the block's stream, not reseeded
        assert draw() == first  # and put back: the block's stream continues unchanged


def test_registered_rngs_are_restored(registry):
    rng = register_rng(random.Random(1), key="iso")
    try:
        expected = random.Random(1).random()
        with isolated():
            assert rng.random() == expected  # not seeded
        assert rng.random() == expected  # restored
    finally:
        unregister_rng(rng)


def test_decorated_function_with_and_without_parentheses():
    @isolated
    def bare():
        return torch.rand(2)

    @isolated()
    def called():
        return torch.rand(2)

    torch.manual_seed(2)
    state = torch.get_rng_state()
    assert torch.equal(bare(), bare())  # each call starts from the caller's state and puts it back
    assert torch.equal(called(), bare())
    assert torch.equal(torch.get_rng_state(), state)
    assert repr(isolated()) == "isolated()"


def test_a_decorated_generator_has_its_own_world_across_yields():
    @isolated
    def gen():
        for _ in range(3):
            yield torch.rand(1).item()

    torch.manual_seed(4)
    expected = [torch.rand(1).item() for _ in range(3)]
    torch.manual_seed(4)
    out = []
    for value in gen():
        out.append(value)
        torch.rand(5)  # the caller draws between steps: the generator does not see it
    assert out == expected


def test_a_decorated_coroutine_and_async_with():
    @isolated
    async def coro():
        await asyncio.sleep(0)
        return torch.rand(1).item()

    async def main():
        torch.manual_seed(6)
        state = torch.get_rng_state()
        first = await coro()
        async with isolated():
            second = torch.rand(1).item()
        assert torch.equal(torch.get_rng_state(), state)
        return first, second

    first, second = asyncio.run(main())
    assert first == second


def test_a_decorated_testcase_runs_each_test_isolated():
    seen = []

    @isolated
    class Case(unittest.TestCase):
        def test_a(self):
            seen.append(torch.rand(1).item())
            torch.manual_seed(123)

        def test_b(self):
            seen.append(torch.rand(1).item())

    torch.manual_seed(8)
    state = torch.get_rng_state()
    result = unittest.TextTestRunner(stream=open(os.devnull, "w")).run(  # noqa: SIM115
        unittest.defaultTestLoader.loadTestsFromTestCase(Case)
    )
    assert result.wasSuccessful()
    assert seen[0] == seen[1]  # test_a's reseed did not reach test_b
    assert torch.equal(torch.get_rng_state(), state)
