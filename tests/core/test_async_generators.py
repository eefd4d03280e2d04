"""reproducible on async generator functions.

That a test leaves every RNG, flag and managed variable as it found them is checked
after each test by the suite's guard (``tests/conftest.py``), not repeated here.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from deterministic_ctx import reproducible
from tests.helpers import draw, solo


@reproducible(seed=6)
async def agen(n):
    for _ in range(n):
        await asyncio.sleep(0)
        yield draw()


def test_is_still_an_async_generator_function():
    assert inspect.isasyncgenfunction(agen)


def test_interleaved_async_generators_and_caller():
    async def consume(n):
        return [v async for v in agen(n)]

    async def noisy_caller():
        for _ in range(10):
            await asyncio.sleep(0)

    async def main():
        a, b, _ = await asyncio.gather(consume(4), consume(4), noisy_caller())
        return a, b

    a, b = asyncio.run(main())
    assert a == b == solo(6, 4)


def test_asend_athrow_aclose():
    seen = []

    @reproducible(seed=6)
    async def echo():
        try:
            received = yield draw()
            assert received == "x"
            try:
                yield draw()
            except KeyError:
                yield draw()
        finally:
            seen.append(draw())

    async def main():
        g = echo()
        first = await g.__anext__()
        second = await g.asend("x")
        third = await g.athrow(KeyError("k"))
        await g.aclose()
        return [first, second, third]

    values = asyncio.run(main())
    assert values == solo(6, 3)
    assert seen == [solo(6, 4)[3]]


def test_exception_in_body_propagates_and_restores():
    @reproducible
    async def bad():
        yield draw()
        raise RuntimeError("agen")

    async def main():
        with pytest.raises(RuntimeError, match="agen"):
            async for _ in bad():
                pass

    asyncio.run(main())


def test_break_out_of_async_for_closes_inside_world():
    async def main():
        g = agen(5)
        async for _ in g:
            break
        await g.aclose()

    asyncio.run(main())  # the suite's guard checks that nothing is left behind
