"""deterministic(): semantics of a block, validation, nesting, exits, soak.

That a test leaves every RNG, flag and managed variable as it found them is checked
after each test by the suite's guard (``tests/conftest.py``), not repeated here.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import warnings

import numpy as np
import pytest
import torch

from deterministic_ctx import StateWarning, deterministic
from deterministic_ctx import sources as sources_module
from deterministic_ctx.base.lock import LOCK
from tests.core.test_interrupts import _lock_free
from tests.helpers import cuda_initialized_after, draw


def _draws() -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def _classic(seed: int) -> tuple:
    with deterministic(seed=0):  # only to leave the test's global state clean
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        return _draws()


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31, 2**32 - 1])
def test_draws_equal_the_classic_recipe(seed):
    with deterministic(seed=seed):
        inside = _draws()
    assert inside == _classic(seed)


def test_numpy_integer_seed_accepted():
    with deterministic(seed=np.uint32(5)) as block:
        inside = _draws()
    assert block.seed == 5 and type(block.seed) is int
    assert inside == _classic(5)


@pytest.mark.parametrize("warn_only", [False, True])
def test_flags_inside(warn_only):
    with deterministic(seed=0, warn_only=warn_only):
        assert torch.backends.cudnn.deterministic is True
        assert torch.backends.cudnn.benchmark is False
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
        assert os.environ["PYTHONHASHSEED"] == "0"


def test_caller_stream_continues_as_if_block_never_ran():
    with deterministic(seed=9):  # keep the test's own global draws contained
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)
        expected = _draws()
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)
        with deterministic(seed=3):
            _draws()
            torch.use_deterministic_algorithms(False)
        assert _draws() == expected


class Boom(Exception):
    pass


@pytest.mark.parametrize("exc_type", [Boom, KeyboardInterrupt, SystemExit])
def test_restores_on_every_exit_route_and_exception_propagates_unchanged(exc_type):
    error = exc_type("x")
    with pytest.raises(exc_type) as info, deterministic(seed=0):
        _draws()
        raise error
    assert info.value is error


def test_return_from_inside_restores():
    def f():
        with deterministic(seed=0):
            return _draws()

    f()  # the suite's guard checks that nothing is left behind


def test_nested_blocks_return_to_the_outer_block():
    with deterministic(seed=1):
        outer_first = _draws()
    with deterministic(seed=1):
        with deterministic(seed=2):
            inner = _draws()
        assert _draws() == outer_first
    assert inner == _classic(2)


def test_same_object_reused_in_a_row_and_nested():
    block = deterministic(seed=4)
    with block:
        a = _draws()
        after_a = _draws()
    with block:
        b = _draws()
        with block:
            c = _draws()
        # the inner exit returned to the outer block's stream
        assert _draws() == after_a
    assert a == b == c == _classic(4)


def test_enter_returns_the_object_and_repr():
    block = deterministic(seed=3, warn_only=True)
    with block as entered:
        assert entered is block
    assert repr(block) == "deterministic(seed=3, warn_only=True)"


@pytest.mark.parametrize(
    ("seed", "exc", "message"),
    [
        ("0", TypeError, r"seed must be an int in 0 \.\. 4294967295.*got str '0'"),
        (1.5, TypeError, "got float 1.5"),
        (None, TypeError, "got NoneType None"),
        (True, TypeError, "got bool True"),
        (np.bool_(True), TypeError, "got bool"),
        (-1, ValueError, r"seed must be in 0 \.\. 4294967295.*got -1"),
        (2**32, ValueError, "got 4294967296"),
    ],
)
def test_bad_seed_rejected_by_the_constructor(seed, exc, message):
    with pytest.raises(exc, match=message):
        deterministic(seed=seed)


def test_bad_warn_only_rejected():
    with pytest.raises(TypeError, match="warn_only must be True or False, got 1"):
        deterministic(seed=0, warn_only=1)  # type: ignore[arg-type]


def test_seed_is_required():
    with pytest.raises(TypeError):
        deterministic()  # type: ignore[call-arg]


class _BrokenApply:
    name = "broken"
    applies_nothing = False  # the Source protocol: its apply does something (it raises)
    fast_paths = ()

    def capture(self):
        return None

    def restore(self, state):
        pass

    def apply(self, settings):
        raise RuntimeError("cannot apply")


def test_failed_entry_is_rolled_back(monkeypatch):
    # Applying stops half-way (the sources before it were applied): all undone.
    srcs = sources_module.SOURCES
    monkeypatch.setattr(sources_module, "SOURCES", (*srcs[:3], _BrokenApply(), *srcs[3:]))
    with pytest.raises(RuntimeError, match="cannot apply"), deterministic(seed=0):
        pytest.fail("body must not run")
    assert LOCK.depth == 0 and _lock_free()  # the lock was released


def test_async_with_restores():

    async def main():
        async with deterministic(seed=2):
            await asyncio.sleep(0)
            return _draws()

    assert asyncio.run(main()) == _classic(2)


def test_block_never_initializes_cuda():
    # In a fresh interpreter: see cuda_initialized_after.
    assert not cuda_initialized_after("""
        import torch
        from deterministic_ctx import deterministic

        with deterministic(seed=0):
            torch.rand(3)
            torch.manual_seed(1)
    """)


def _tracker() -> tuple:
    t = torch.cuda._lazy_seed_tracker
    return (t.manual_seed_all_cb, t.manual_seed_cb, tuple(t.call_order))


@pytest.mark.slow
def test_soak_ten_thousand_blocks_flat_memory_and_queue():
    queue_before = len(torch.cuda._queued_calls)
    tracker_before = _tracker()
    block = deterministic(seed=0)
    for _ in range(500):  # warm caches and allocator
        with block:
            torch.rand(1)
    gc.collect()
    blocks_before = sys.getallocatedblocks()
    for i in range(10_000):
        with block:
            torch.rand(1)
            if i % 10 == 0:
                torch.manual_seed(1)  # queues lazy seeds: must not accumulate
    gc.collect()
    grown = sys.getallocatedblocks() - blocks_before
    assert len(torch.cuda._queued_calls) == queue_before
    assert _tracker() == tracker_before
    # A leak of one object per block would show as >= 10 000 blocks.
    assert grown < 500, f"{grown} more allocated blocks after 10 000 blocks"


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        (
            {"seed": 10**5000},
            ValueError,
            r"seed must be in 0 \.\. 4294967295.*got an int of 16610 bits",
        ),
        ({"seed": -(10**5000)}, ValueError, r"seed must be .*got a negative int of 16610 bits"),
        (
            {"seed": 0, "rank": -(10**5000)},
            ValueError,
            r"rank must be .*got a negative int of 16610 bits",
        ),
        ({"seed": np.uint64(2**64 - 1)}, ValueError, r"seed must be .*got 18446744073709551615"),
    ],
)
def test_integers_of_any_size_get_an_error_naming_the_argument(kwargs, exc, message):
    # int -> str refuses more than 4300 digits: the message must not need it.
    with pytest.raises(exc, match=message):
        deterministic(**kwargs)


def test_huge_rank_is_a_valid_rank():
    with deterministic(seed=0, rank=10**5000):
        a = draw()
    with deterministic(seed=0, rank=10**5000):
        assert draw() == a


def test_rebinding_random_random_in_a_block_warns_at_the_next_block():
    # ``random.random = other.random`` makes blocks stop seeding what
    # ``random.random()`` draws: silent irreproducibility, so it warns.
    original = random.random
    other = random.Random(5)
    try:
        with deterministic(seed=0):
            random.random = other.random
        with (
            pytest.warns(StateWarning, match="random.random is no longer a method"),
            deterministic(seed=0),
        ):
            pass
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with deterministic(seed=0):  # said once per rebinding
                pass
    finally:
        random.random = original
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with deterministic(seed=0):
            pass


def test_an_exit_without_an_entry_is_a_misuse_error():
    from deterministic_ctx import MisuseError

    with pytest.raises(MisuseError, match="exited without being entered"):
        deterministic(seed=0).__exit__(None, None, None)
