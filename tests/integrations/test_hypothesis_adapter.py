"""deterministic_ctx.integrations.hypothesis: Hypothesis seeds and restores torch and the registered RNGs.

The adapter is tested alone in this process; registration with Hypothesis, which lasts for the
life of a process, only in a child run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deterministic_ctx import deterministic, register_rng, unregister_rng
from deterministic_ctx.integrations.hypothesis import TorchRandom
from tests.helpers import cuda_initialized_after

seeds = st.integers(0, 2**32 - 1)


@pytest.fixture(scope="module")  # module-scoped: @given reuses it across examples
def rngs() -> Iterator[tuple[random.Random, torch.Generator]]:
    augment = register_rng(random.Random(5), key="test-hypothesis-augment")
    noise = register_rng(torch.Generator().manual_seed(6), key="test-hypothesis-noise")
    yield augment, noise
    unregister_rng(augment)
    unregister_rng(noise)


def _draw(rngs: tuple[random.Random, torch.Generator]) -> tuple[object, ...]:
    augment, noise = rngs
    return torch.rand(3), augment.random(), torch.rand(2, generator=noise)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


@given(seed=seeds, n=st.integers(0, 5))
def test_getstate_setstate_round_trip_bit_for_bit(rngs, seed: int, n: int) -> None:
    adapter = TorchRandom()
    state = adapter.getstate()
    before = _draw(rngs)
    adapter.setstate(state)
    adapter.seed(seed)
    for _ in range(n):
        _draw(rngs)
    adapter.setstate(state)
    assert _same(_draw(rngs), before)  # the streams continue as if nothing had run
    adapter.setstate(state)


@given(seed=seeds)
def test_seed_draws_what_a_block_with_the_seed_draws(rngs, seed: int) -> None:
    adapter = TorchRandom()
    state = adapter.getstate()
    try:
        adapter.seed(seed)
        drawn = _draw(rngs)
        with deterministic(seed=seed):
            assert _same(_draw(rngs), drawn)
        assert torch.equal(torch.rand(3, generator=torch.Generator().manual_seed(seed)), drawn[0])
    finally:
        adapter.setstate(state)


def test_seed_leaves_python_random_and_numpy_to_hypothesis() -> None:
    adapter = TorchRandom()
    state = adapter.getstate()
    outside = (random.getstate(), repr(__import__("numpy").random.get_state()))
    try:
        adapter.seed(0)
        assert (random.getstate(), repr(__import__("numpy").random.get_state())) == outside
    finally:
        adapter.setstate(state)


def test_seed_never_initializes_cuda() -> None:
    # In a fresh interpreter: see cuda_initialized_after.
    assert not cuda_initialized_after("""
        from deterministic_ctx.integrations.hypothesis import TorchRandom

        adapter = TorchRandom()
        state = adapter.getstate()
        adapter.seed(0)
        adapter.setstate(state)
    """)


def test_disabled_adapter_is_inert_but_restores_what_it_captured() -> None:
    adapter = TorchRandom()
    state = adapter.getstate()
    before = torch.get_rng_state()
    adapter.enabled = False
    assert adapter.getstate() is None
    adapter.seed(0)  # does nothing
    assert torch.equal(torch.get_rng_state(), before)
    adapter.setstate(None)
    torch.rand(4)
    adapter.setstate(state)  # captured while enabled: still restored
    assert torch.equal(torch.get_rng_state(), before)
    assert "disabled" in repr(adapter)


@pytest.mark.parametrize("bad", [(), [None], "state", (None,) * 99])
def test_setstate_rejects_a_foreign_state(bad: object) -> None:
    with pytest.raises(TypeError, match=r"TorchRandom\.getstate"):
        TorchRandom().setstate(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bad", "error"), [(-1, ValueError), (2**32, ValueError), ("1", TypeError)]
)
def test_seed_rejects_what_a_block_rejects(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        TorchRandom().seed(bad)  # type: ignore[arg-type]


# -- with Hypothesis, in a child run ----------------------------------------------------------

# Without the adapter, torch's stream runs on from example to example: one of 300 examples
# draws below 0.05 and fails, and its replay draws another number and passes, which Hypothesis
# reports as flaky.  With it, every example starts from torch.manual_seed(0) (0.4963 first).
DRAWS = """
import torch
from hypothesis import given, settings, strategies as st


@settings(derandomize=True, database=None, max_examples=300, deadline=None)
@given(st.integers())
def test_draws(n):
    assert torch.rand(()).item() > 0.05
"""

MANAGED = """
import pytest
import torch
from hypothesis import given, settings, strategies as st

import deterministic_ctx.integrations.hypothesis
from deterministic_ctx import register_rng

import test_unmanaged

AUGMENT = register_rng(torch.Generator(), key="augment")


@pytest.fixture(scope="module", autouse=True)
def adapter():
    # Registered for this module's tests only: test_unmanaged.py runs after it.
    yield deterministic_ctx.integrations.hypothesis.register()
    deterministic_ctx.integrations.hypothesis.unregister()


def test_draws(adapter):
    assert deterministic_ctx.integrations.hypothesis.register() is adapter  # idempotent
    torch.manual_seed(1)
    before = torch.get_rng_state(), AUGMENT.get_state()
    test_unmanaged.test_draws()  # the same @given test, managed: it passes
    # Hypothesis put the caller's streams back, bit for bit.
    assert torch.equal(torch.get_rng_state(), before[0])
    assert torch.equal(AUGMENT.get_state(), before[1])


@settings(database=None, max_examples=20)
@given(st.random_module())
def test_random_module_seeds_torch_too(seeder):
    expected = torch.rand(2, generator=torch.Generator().manual_seed(seeder.seed))
    assert torch.equal(torch.rand(2), expected)
"""


@pytest.mark.slow
def test_hypothesis_reports_torch_draws_flaky_unless_the_adapter_is_registered(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_unmanaged=DRAWS, test_managed=MANAGED)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["*FlakyFailure*unreliable results*", "FAILED test_unmanaged.py::test_draws*"]
    )
