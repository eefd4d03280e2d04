"""reproducible on generator functions: a private RNG world swapped at every yield.

That a test leaves every RNG, flag and managed variable as it found them is checked
after each test by the suite's guard (``tests/conftest.py``), not repeated here.
"""

from __future__ import annotations

import gc
import importlib
import sys
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deterministic_ctx import (
    RngStreams,
    _torch,
    allow_nondeterministic,
    deterministic,
    register_rng,
    reproducible,
    unregister_rng,
)
from deterministic_ctx._torch.internals import write_config_override
from tests.helpers import draw, needs, solo


@reproducible(seed=5)
def stream(n):
    for _ in range(n):
        yield draw()


def test_values_equal_solo_whatever_the_caller_draws_between():
    with deterministic(seed=100):
        gen = stream(4)
        values = []
        for value in gen:
            values.append(value)
            draw()
            draw()
    assert values == solo(5, 4)


def test_caller_stream_is_as_if_generator_never_ran():
    with deterministic(seed=1):
        expected = [draw() for _ in range(4)]
    with deterministic(seed=1):
        gen = stream(10)
        got = []
        for _ in range(4):
            next(gen)
            got.append(draw())
        gen.close()
    assert got == expected


def test_seeded_on_first_next_not_at_creation():
    with deterministic(seed=1):
        gen = stream(1)
        draw()  # between creation and first next()
        assert next(gen) == solo(5, 1)[0]
        gen.close()


def test_two_interleaved_generators_are_independent():
    a, b = stream(3), stream(3)
    out_a, out_b = [], []
    for _ in range(3):
        out_a.append(next(a))
        out_b.append(next(b))
    assert out_a == out_b == solo(5, 3)


def test_send_and_return_value():
    @reproducible(seed=2)
    def echo():
        total = 0
        while True:
            received = yield draw()
            if received is None:
                return total
            total += received

    gen = echo()
    first = next(gen)
    second = gen.send(10)
    with pytest.raises(StopIteration) as stop:
        gen.send(None)
    assert stop.value.value == 10
    assert [first, second] == solo(2, 2)


def test_throw_runs_handler_inside_world_and_caller_untouched():
    @reproducible(seed=2)
    def gen():
        try:
            yield draw()
        except KeyError:
            yield draw()

    g = gen()
    first = next(g)
    second = g.throw(KeyError("k"))
    assert [first, second] == solo(2, 2)
    g.close()


def test_close_runs_finally_inside_world():
    seen = []

    @reproducible(seed=2)
    def gen():
        try:
            yield draw()
            yield draw()
        finally:
            seen.append(draw())

    g = gen()
    next(g)
    g.close()
    assert seen == [solo(2, 2)[1]]


def test_garbage_collection_of_suspended_generator_leaves_caller_intact():
    g = stream(5)
    next(g)
    del g
    gc.collect()  # the suite's guard checks that nothing is left behind


def _numpy_lock_held(bit_generators: list[Any]) -> bool:
    """Whether one of the NumPy bit generators' locks is held where the garbage
    collector starts, on NumPy 1.x: a plain ``Lock``, which the closing would
    wait for for ever.  NumPy 2's are ``RLock``s: the closing then proceeds
    under it, and its values and the outer block's state are checked."""
    return any(
        not isinstance(bg.lock, type(threading.RLock())) and bg.lock.locked()
        for bg in bit_generators
    )


@pytest.mark.parametrize(
    "operation",
    [
        "with",
        "decorated",
        "generator",
        "fork",
        pytest.param("exemption", marks=needs(_torch.SCOPED_EXEMPTION)),
    ],
)
def test_a_generator_collected_at_any_allocation_of_a_block_closes_in_its_own(operation):
    """The garbage collector runs finalizers at any allocation, the library's own
    included: a suspended decorated generator collected there closes in its own
    block, nested in the middle of another block's entry or exit.  The closing
    gives its own values and leaves the outer block's state whole.  And no
    collection starts where the closing cannot run: under NumPy 1.x's bit
    generator lock (not reentrant: the closing would wait for it for ever), or
    inside a ``ContextVar.set`` of torch's config (the closing's own set would
    free the mapping it is building from: a crash, seen on torch 2.13).  torch
    2.1's ``Generator.get_state`` holds the generator's mutex there: the fork
    case hung on it."""
    # With inductor's config imported, every block writes one of its entries (a
    # ContextVar from torch 2.12), and so does the closing nested in it.
    importlib.import_module("torch._inductor.config")
    seen = []

    @reproducible(seed=5)
    def gen():
        try:
            yield draw()
        finally:
            seen.append(draw())

    @reproducible(seed=6)
    def decorated():
        return draw()

    def with_block():
        with deterministic(seed=6):
            return draw()

    @reproducible(seed=6)
    def steps():
        try:
            yield draw()
            yield draw()
        finally:
            draw()

    def stepped():
        it = steps()
        values = [next(it), next(it)]
        it.close()
        return values

    streams = RngStreams(8, {"tp": (0, 2)}, key="collected")
    streams.add("tp", varies=["tp"])

    def fork():
        with deterministic(seed=6), streams.fork("tp"):
            return draw()

    def exempted():
        with deterministic(seed=6), allow_nondeterministic("aten::index_add"):
            return draw()

    run = {
        "with": with_block,
        "decorated": decorated,
        "generator": stepped,
        "fork": fork,
        "exemption": exempted,
    }[operation]
    g = gen()
    next(g)
    g.close()
    expected, inner = seen.pop(), run()
    collections = 0
    fire_at = 0
    pending: list[Any] = []
    problems: list[Any] = []
    deferred: list[Any] = []

    def collector(phase: str, info: Any) -> None:
        nonlocal collections
        if phase != "start":
            return
        collections += 1
        if collections == fire_at and pending:
            frame = sys._getframe(1)
            if _numpy_lock_held(bit_generators):
                problems.append((fire_at, "a collection while NumPy's lock is held"))
                deferred.append(pending.pop())  # closed after the operation
            elif frame.f_code is write_config_override.__code__ and frame.f_locals["var"]:
                # Inside ContextVar.set, which holds its context's old mapping by a
                # borrowed reference: the closing's own set would free it (a crash).
                problems.append((fire_at, "a collection inside a ContextVar write"))
                deferred.append(pending.pop())
            else:
                pending.pop().close()  # what the generator's finalizer does

    # Registered NumPy RNGs of both kinds too: their copies take their own locks.
    registered = [np.random.default_rng(1), np.random.RandomState(2)]
    bit_generators = [np.random.mtrand._rand._bit_generator]
    bit_generators += [rng._bit_generator for rng in registered]
    threshold = gc.get_threshold()
    gc.callbacks.append(collector)
    for rng in registered:
        register_rng(rng)
    try:
        # A young-generation collection at every allocation of a tracked object;
        # none of the older ones, which thousands of young ones would otherwise
        # trigger by the hundred (whole-heap passes the sweep does not need).
        gc.set_threshold(1, 2**30, 2**30)
        for k in range(1, 1000):
            pending.append(gen())
            next(pending[-1])
            collections, fire_at = 0, k
            assert run() == inner, k
            while deferred:
                deferred.pop().close()
            if pending:  # k is past the operation's last collection
                pending.pop().close()
                break
            assert seen.pop() == expected, k
        assert k > 5, "the collector ran inside the operation"
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(collector)
        for rng in registered:
            unregister_rng(rng)
    assert problems == []


def test_exception_from_body_propagates_and_restores():
    @reproducible
    def bad():
        yield draw()
        raise RuntimeError("body")

    g = bad()
    next(g)
    with pytest.raises(RuntimeError, match="body"):
        next(g)


def test_unstarted_generator_close_is_harmless():
    g = stream(2)
    g.close()  # the suite's guard checks that nothing is left behind


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["caller", "a", "b", "c"]), max_size=30))
def test_any_interleaving_gives_every_stream_its_solo_values(order):
    n = 30
    gens = {"a": stream(n), "b": stream(n), "c": stream(n)}
    got = {k: [] for k in gens}
    with deterministic(seed=77):
        caller = []
        for who in order:
            if who == "caller":
                caller.append(draw())
            else:
                got[who].append(next(gens[who]))
    for g in gens.values():
        g.close()
    reference = solo(5, n)
    for values in got.values():
        assert values == reference[: len(values)]
    assert caller == solo(77, len(caller))
