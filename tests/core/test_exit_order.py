"""Blocks that leave in any order: ``async with`` tasks, shared objects, generators.

Once every block has left, the state is exactly the one before the first
entered; meanwhile the live state is the world of the most recently entered
block that is still open.  That the state after the last exit is the one before the
first entry is checked after each test by the suite's guard (``tests/conftest.py``); the
property tests check it after each example.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deterministic_ctx import Snapshot, deterministic, reproducible
from deterministic_ctx.base.lock import LOCK
from deterministic_ctx.base.scopes import SCOPES
from tests._oracle import World
from tests.helpers import draw, solo


class _Boom(Exception):
    pass


def test_two_tasks_leaving_in_entry_order_leave_nothing_behind():
    # The issue's case: task 1 enters first and leaves first, while task 2's
    # block is still open.

    async def task(seed, delay):
        async with deterministic(seed=seed):
            draw()
            await asyncio.sleep(delay)
            draw()

    async def main():
        await asyncio.gather(task(1, 0.01), task(2, 0.05))

    asyncio.run(main())
    assert LOCK.depth == 0


def test_one_shared_object_entered_by_two_tasks():
    det = deterministic(seed=7)

    async def task(delay):
        async with det:
            draw()
            await asyncio.sleep(delay)
            draw()

    async def main():
        await asyncio.gather(task(0.01), task(0.05))

    asyncio.run(main())
    assert not [w for w in SCOPES.withs() if w.of is det and not w.exited]


def test_task_leaving_first_does_not_change_the_other_tasks_world():
    # Task 2 entered last, so its world is live; task 1 leaving while it is
    # open hands its saved state on instead of restoring over task 2's world.
    seen = {}

    async def first(det_started, second_entered):
        async with deterministic(seed=1):
            det_started.set()
            await second_entered.wait()
        seen["after first left"] = draw()

    async def second(det_started, second_entered, first_left):
        await det_started.wait()
        async with deterministic(seed=2):
            seen["entered"] = draw()
            second_entered.set()
            await asyncio.sleep(0.02)  # the first task leaves meanwhile
            seen["still inside"] = draw()

    async def main():
        a, b, c = asyncio.Event(), asyncio.Event(), asyncio.Event()
        await asyncio.gather(first(a, b), second(a, b, c))

    asyncio.run(main())
    # The second block's stream went on undisturbed by the first one leaving
    # (the first task's draw after leaving came from the live, second world).
    assert [seen["entered"], seen["after first left"], seen["still inside"]] == solo(2, 3)


def test_manual_exits_in_reverse_of_entry_order_of_distinct_objects():
    a, b = deterministic(seed=1), deterministic(seed=2)
    a.__enter__()
    draw()
    b.__enter__()
    draw()
    a.__exit__(None, None, None)  # a leaves while b is open: nothing restored yet
    inside_b = draw()
    b.__exit__(None, None, None)
    assert inside_b == solo(2, 2)[1]


def test_plain_generator_closed_inside_another_block():
    # A generator holding a block open across its yield, closed while a later
    # block is open: the generator's block leaves first.
    def gen():
        with deterministic(seed=1):
            yield draw()
            yield draw()

    g = gen()
    next(g)
    with deterministic(seed=2):
        g.close()
        assert draw() == solo(2, 1)[0]


def test_decorated_generator_carries_blocks_opened_in_its_step():
    # A block opened in a step of a decorated generator and still open at its
    # yield belongs to the generator's world: it leaves with the step, the
    # lock is free between steps, and the values do not depend on the caller.
    @reproducible(seed=1)
    def gen():
        with deterministic(seed=5):
            for _ in range(3):
                yield draw()
        yield draw()

    solo_values = list(gen())
    caller = Snapshot.capture()  # the caller draws between steps: put its RNGs back after
    g = gen()
    values = []
    for _ in range(4):
        values.append(next(g))
        assert LOCK.depth == 0
        draw()  # the caller's own stream, between steps
    assert values == solo_values
    assert values[:3] == solo(5, 3)
    with pytest.raises(StopIteration):
        next(g)
    caller.restore()


def test_carried_block_closed_from_outside_while_its_generator_is_suspended():
    # The inner generator's block was opened in the decorated generator's
    # step; closing the inner generator from outside removes that block from
    # the suspended world, and the world after it is as before it.
    inner_holder = {}

    def inner():
        with deterministic(seed=9):
            yield draw()
            yield draw()

    @reproducible(seed=1)
    def outer():
        it = inner()
        inner_holder["it"] = it
        yield next(it)  # the inner block stays open across this yield
        yield draw()  # after the inner generator was closed from outside

    g = outer()
    first = next(g)
    inner_holder["it"].close()  # outside every block: the carried block leaves
    second = next(g)
    g.close()
    assert first == solo(9, 1)[0]
    with deterministic(seed=1):
        assert second == draw()  # the outer world continues as if the inner block never ran


# -- any interleaving ---------------------------------------------------------------


@st.composite
def _plans(draw_):
    n = draw_(st.integers(2, 5))
    tasks = []
    for i in range(n):
        tasks.append(
            {
                "seed": draw_(st.integers(0, 2**32 - 1)),
                "start": draw_(st.integers(0, 4)),  # awaits before entering
                "inside": draw_(st.lists(st.integers(0, 3), min_size=1, max_size=4)),
                "raises": draw_(st.booleans()),
                "shared": draw_(st.booleans()),
                "i": i,
            }
        )
    return tasks


async def _run_plan(plan):
    shared = deterministic(seed=12345)

    async def task(spec):
        for _ in range(spec["start"]):
            await asyncio.sleep(0)
        det = shared if spec["shared"] else deterministic(seed=spec["seed"])
        async with det:
            for pause in spec["inside"]:
                random.random()
                np.random.rand()
                torch.rand(1)
                for _ in range(pause):
                    await asyncio.sleep(0)
            if spec["raises"]:
                raise _Boom(spec["i"])

    return await asyncio.gather(*(task(s) for s in plan), return_exceptions=True)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plan=_plans())
def test_any_interleaving_of_tasks_leaves_the_state_from_before_the_first(plan):
    before = World.now()
    results = asyncio.run(_run_plan(plan))
    assert World.now() == before
    assert LOCK.depth == 0
    for spec, result in zip(plan, results, strict=True):
        assert isinstance(result, _Boom) if spec["raises"] else result is None


@settings(max_examples=100, deadline=None)
@given(
    seeds=st.lists(st.integers(0, 100), min_size=2, max_size=5),
    perm=st.permutations(range(5)),
    draws=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_any_exit_order_of_open_blocks(seeds, perm, draws):
    # Distinct objects entered in a row and left in a random order, with draws
    # in between: after the last exit, nothing of any block is left.
    before = World.now()
    blocks = [deterministic(seed=s) for s in seeds]
    for k, block in enumerate(blocks):
        block.__enter__()
        if draws[k]:
            draw()
    leaving = [blocks[i] for i in perm if i < len(blocks)]
    for k, block in enumerate(leaving):
        block.__exit__(None, None, None)
        if draws[5 + k % 5] and k + 1 < len(leaving):
            draw()
    assert World.now() == before
    assert LOCK.depth == 0
