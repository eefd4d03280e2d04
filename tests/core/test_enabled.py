"""``deterministic(..., enabled=False)``: every use of the object does nothing."""

from __future__ import annotations

import asyncio
import random
import threading
import unittest

import numpy as np
import pytest
import torch

from deterministic_ctx import deterministic, isolated, reproducible
from deterministic_ctx.base.lock import LOCK
from deterministic_ctx.base.scopes import SCOPES
from tests.helpers import draw


def _seed(n: int) -> None:
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def test_a_disabled_block_neither_seeds_nor_isolates_nor_takes_the_lock():
    with isolated():  # the disabled block keeps what its body changes: the test must not
        _seed(5)
        expected = [draw(), draw()]
        _seed(5)
        first = draw()
        open_blocks = len(SCOPES.active)
        with deterministic(seed=0, enabled=False):
            assert len(SCOPES.active) == open_blocks
            inside = draw()
            torch.use_deterministic_algorithms(True)  # kept: nothing is restored
        assert [first, inside] == expected
        assert torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(False)


def test_a_disabled_async_block_is_a_no_op():
    async def main() -> tuple[object, ...]:
        async with deterministic(seed=0, enabled=False):
            assert not LOCK.mine()  # asyncio.run's thread holds no block
            return draw()

    @isolated
    def run() -> None:
        _seed(6)
        expected = draw()
        _seed(6)
        # In a thread of its own: asyncio.run in this thread's block would find it open.
        result: list[object] = []
        thread = threading.Thread(target=lambda: result.append(asyncio.run(main())))
        thread.start()
        thread.join()
        assert result == [expected]

    run()


def test_disabled_exits_need_no_entry():
    det = deterministic(seed=0, enabled=False)
    det.__exit__(None, None, None)  # like fork_rng(enabled=False): nothing to leave


def test_a_disabled_decorator_returns_the_function_itself():
    def f() -> int:
        return 1

    class Case(unittest.TestCase):
        pass

    assert deterministic(seed=0, enabled=False)(f) is f
    assert reproducible(seed=0, enabled=False)(f) is f
    assert reproducible(f, enabled=False) is f
    assert reproducible(enabled=False)(Case) is Case
    assert reproducible(enabled=True)(f) is not f


@pytest.mark.parametrize("value", [0, 1, "False", None])
def test_enabled_must_be_a_bool(value):
    with pytest.raises(TypeError, match=r"enabled must be True or False"):
        deterministic(seed=0, enabled=value)
    with pytest.raises(TypeError, match=r"enabled must be True or False"):
        reproducible(seed=0, enabled=value)


def test_the_other_options_are_still_checked_when_disabled():
    with pytest.raises(ValueError, match="seed"):
        deterministic(seed=-1, enabled=False)


def test_enabled_in_the_repr_and_as_a_property():
    assert deterministic(seed=0).enabled
    off = deterministic(seed=0, enabled=False)
    assert not off.enabled
    assert repr(off) == "deterministic(seed=0, warn_only=False, enabled=False)"
