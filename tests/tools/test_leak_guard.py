"""The suite's own guard (``tests/conftest.py``) sees registrations that a test leaves behind.

Inner test runs (``pytester``, in this process) use the guard's fixtures; each plants a
leftover and the guard must fail that test, naming it, and pass a test that cleans up.
What an inner test leaves registered is unregistered here afterwards, so that this test
itself leaves nothing behind (and its own guard checks that).
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator

import pytest

from deterministic_ctx import managed_env_vars, registered_rngs, unregister_rng

CONFTEST = """
from tests.conftest import _no_global_state_leak, registry  # the guard under test
"""

INNER = """
import random

import pytest
import torch

from deterministic_ctx import register_env_var, register_rng, unregister_rng

HELD = []


def test_leaves_an_rng_registered():
    HELD.append(register_rng(random.Random(1), key="guard-leftover-rng"))


def test_leaves_a_strongly_held_one_after_dropping_it():
    import numpy as np  # NumPy's generators cannot be weakly referenced: dropping is no unregister

    register_rng(np.random.default_rng(2), key="guard-leftover-numpy")


def test_registers_an_env_var():
    register_env_var("GUARD_LEFTOVER_VAR")


def test_registers_an_env_var_with_the_fixture(registry):
    register_env_var("GUARD_FIXTURE_VAR")


def test_drops_a_weakly_held_one_in_a_cycle():
    # Kept alive by a reference cycle until the next collection: not a leak.
    rng = register_rng(random.Random(3), key="guard-cycle")
    rng.self = rng


def test_cleans_up():
    rng = register_rng(random.Random(4), key="guard-clean")
    unregister_rng(rng)
"""


@pytest.fixture
def inner_leftovers(registry: None) -> Iterator[None]:
    """Whatever the inner tests leave registered goes once the test is over
    (the ``registry`` fixture takes back the environment variables)."""
    yield
    for key, obj in registered_rngs():
        if key.startswith("guard-"):
            unregister_rng(obj)
    gc.collect()


def test_the_guard_fails_a_test_that_leaves_a_registration(
    pytester: pytest.Pytester, inner_leftovers: None
) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider")
    # Each leaking test fails in the guard's teardown (an error), naming its leftover.
    result.assert_outcomes(passed=6, errors=3)
    out = result.stdout.str()
    for test, named in [
        ("test_leaves_an_rng_registered", "['guard-leftover-rng']"),
        ("test_leaves_a_strongly_held_one_after_dropping_it", "['guard-leftover-numpy']"),
        ("test_registers_an_env_var", "['GUARD_LEFTOVER_VAR']"),
    ]:
        assert f"ERROR at teardown of {test} " in out, out
        assert named in out
    assert "user RNGs left registered under the keys ['guard-leftover-rng']" in out
    assert "environment variables registered: ['GUARD_LEFTOVER_VAR']" in out
    for clean in ("guard-cycle", "guard-clean", "GUARD_FIXTURE_VAR"):
        assert clean not in out  # no false alarm: collected, unregistered, or taken back
    assert "GUARD_LEFTOVER_VAR" in managed_env_vars()  # it was registered for real


def test_the_guard_fails_a_test_that_unregisters_what_it_did_not_register(
    pytester: pytest.Pytester, inner_leftovers: None
) -> None:
    # Registered out here, before the inner test starts; the inner one takes it away.
    rng = random.Random(5)
    from deterministic_ctx import register_rng

    register_rng(rng, key="guard-outer")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_inner="""
from deterministic_ctx import registered_rngs, unregister_rng

def test_unregisters_another_tests_rng():
    (outer,) = [obj for key, obj in registered_rngs() if key == "guard-outer"]
    unregister_rng(outer)
"""
    )
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    assert "user RNGs registered before the test unregistered: ['guard-outer']" in (
        result.stdout.str()
    )
    assert "guard-outer" not in [key for key, _ in registered_rngs()]
