"""reproducible on functions and methods; @deterministic as a decorator; bad input.

That a test leaves every RNG, flag and managed variable as it found them is checked
after each test by the suite's guard (``tests/conftest.py``), not repeated here.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import pytest

from deterministic_ctx import deterministic, reproducible
from tests.helpers import draw, solo


def test_bare_decorator_uses_seed_zero_and_restores():
    @reproducible
    def f(n):
        return [draw() for _ in range(n)]

    assert f(3) == f(3) == solo(0, 3)


@pytest.mark.parametrize("make", [lambda: reproducible(), lambda: reproducible(seed=0)])
def test_called_decorator_forms(make):
    @make()
    def f():
        return draw()

    assert f() == solo(0, 1)[0]


def test_seed_and_warn_only():
    import torch

    @reproducible(seed=3, warn_only=True)
    def f():
        return draw(), torch.is_deterministic_algorithms_warn_only_enabled()

    values, warn_only = f()
    assert values == solo(3, 1)[0] and warn_only is True


def test_deterministic_as_decorator_is_reproducible():
    @deterministic(seed=3)
    def f():
        return draw()

    @deterministic(seed=3)
    def g():
        yield draw()

    assert f() == solo(3, 1)[0]
    assert inspect.isgeneratorfunction(g) and list(g()) == solo(3, 1)


def test_metadata_is_kept():
    def original(a: int, b: int = 2) -> int:
        """Doc."""
        return a + b

    wrapped = reproducible(original)
    assert wrapped.__name__ == "original" and wrapped.__doc__ == "Doc."
    assert wrapped.__wrapped__ is original
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert wrapped(1) == 3


def test_exception_propagates_and_state_restored():
    @reproducible
    def f():
        draw()
        raise ValueError("inner")

    with pytest.raises(ValueError, match="inner"):
        f()


class Model:
    def __init__(self):
        self.calls = 0

    @reproducible(seed=1)
    def method(self):
        self.calls += 1
        return draw()

    @reproducible(seed=1)
    @staticmethod
    def static():
        return draw()

    @reproducible(seed=1)
    @classmethod
    def klass(cls):
        return cls.__name__, draw()


def test_methods_static_and_class_methods():
    m = Model()
    assert m.method() == m.method() == solo(1, 1)[0]
    assert m.calls == 2
    assert Model.static() == solo(1, 1)[0]
    assert Model.klass() == ("Model", solo(1, 1)[0])


def test_partial_and_callable_objects():
    class Callable:
        def __call__(self, k):
            return [draw() for _ in range(k)]

    assert reproducible(Callable())(2) == solo(0, 2)
    assert reproducible(functools.partial(lambda k: [draw() for _ in range(k)], 2))() == solo(0, 2)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"seed": "1"}, TypeError, "seed must be an int"),
        ({"seed": -1}, ValueError, "seed must be in 0"),
        ({"warn_only": "yes"}, TypeError, "warn_only must be True or False"),
    ],
)
def test_bad_arguments_fail_at_decoration(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        reproducible(**kwargs)


def test_non_callables_and_plain_classes_rejected():
    with pytest.raises(TypeError, match=r"expects a callable.*got int 3"):
        reproducible(3)

    with pytest.raises(TypeError, match=r"cannot decorate class .*Plain: only functions"):

        @reproducible
        class Plain:
            pass


def test_bare_deterministic_as_a_decorator_says_to_give_a_seed():
    from deterministic_ctx import deterministic

    with pytest.raises(
        TypeError, match=r"deterministic needs a seed: write @deterministic\(seed=0\) above f"
    ):

        @deterministic
        def f():
            pass


def test_reproducible_above_property_says_to_put_it_below():
    from deterministic_ctx import reproducible

    with pytest.raises(TypeError, match="put it below @property"):

        class A:
            @reproducible
            @property
            def x(self):
                return 1

    class B:  # the order that works
        @property
        @reproducible(seed=3)
        def x(self):
            return np.random.rand()

    assert B().x == B().x
