"""reproducible on coroutine functions: isolation across every await.

That a test leaves every RNG, flag and managed variable as it found them is checked
after each test by the suite's guard (``tests/conftest.py``), not repeated here.
"""

from __future__ import annotations

import asyncio
import inspect
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deterministic_ctx import deterministic, reproducible
from tests.helpers import draw, solo


@reproducible(seed=5)
async def sampler(n, pause=0.0):
    out = []
    for _ in range(n):
        out.append(draw())
        await asyncio.sleep(pause)
    return out


def test_is_still_a_coroutine_function():
    assert inspect.iscoroutinefunction(sampler)


def test_gather_interleaved_coroutines_each_get_their_solo_values():
    async def main():
        return await asyncio.gather(sampler(4), sampler(4, 0.001), sampler(4))

    results = asyncio.run(main())
    assert results == [solo(5, 4)] * 3


def test_caller_task_drawing_between_awaits_is_isolated():
    async def caller():
        out = []
        for _ in range(4):
            out.append(draw())
            await asyncio.sleep(0)
        return out

    async def main():
        results = []
        for _ in range(2):
            results.append(await asyncio.gather(_isolated_caller(caller), sampler(4)))
        return results

    async def _isolated_caller(fn):
        return await reproducible(seed=9)(fn)()

    results = asyncio.run(main())
    for caller_values, sampler_values in results:
        assert caller_values == solo(9, 4)
        assert sampler_values == solo(5, 4)


def test_exception_and_cancellation_restore():
    @reproducible
    async def boom():
        draw()
        await asyncio.sleep(0)
        raise ValueError("async")

    @reproducible
    async def forever():
        while True:
            draw()
            await asyncio.sleep(0)

    async def main():
        with pytest.raises(ValueError, match="async"):
            await boom()
        task = asyncio.ensure_future(forever())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


class _Yield:
    def __await__(self):
        yield "tick"


def run_round_robin(*coros):
    """A minimal event loop that knows nothing of asyncio."""
    results: list = [None] * len(coros)
    pending = dict(enumerate(coros))
    while pending:
        for index, coro in list(pending.items()):
            try:
                assert coro.send(None) == "tick"
            except StopIteration as stop:
                results[index] = stop.value
                del pending[index]
    return results


def test_works_without_asyncio():
    @reproducible(seed=5)
    async def ticker(n):
        out = []
        for _ in range(n):
            out.append(draw())
            await _Yield()
        return out

    assert run_round_robin(ticker(3), ticker(3)) == [solo(5, 3)] * 2


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=20))
def test_any_schedule_gives_solo_values(schedule):
    @reproducible(seed=5)
    async def ticker(out):
        while True:
            out.append(draw())
            await _Yield()

    outs: list[list] = [[], [], []]
    coros = [ticker(out) for out in outs]
    with deterministic(seed=1):
        caller = []
        for who in schedule:
            coros[who].send(None)
            caller.append(draw())
    for coro in coros:
        coro.close()
    for out in outs:
        assert out == solo(5, len(out))
    assert caller == solo(1, len(caller))


def test_awaitable_object_steps_are_isolated():
    from deterministic_ctx.base.settings import Settings
    from deterministic_ctx.core.decorate import _steps
    from deterministic_ctx.core.engine import Block

    @types.coroutine
    def gen_coro():
        yield "tick"
        return draw()

    class Awaitable:
        def __await__(self):
            return gen_coro()

    coro = _steps(Awaitable(), Block(Settings(5, False)), final=True)
    assert next(coro) == "tick"
    with pytest.raises(StopIteration) as stop:
        coro.send(None)
    assert stop.value.value == solo(5, 1)[0]
