"""register_rng: user-owned RNGs captured, seeded and restored with every block."""

from __future__ import annotations

import gc
import random
from typing import ClassVar

import numpy as np
import pytest
import torch

from deterministic_ctx import (
    derive_seed,
    deterministic,
    register_rng,
    registered_rngs,
    unregister_rng,
)


def _draw(rng):
    if isinstance(rng, random.Random):
        return rng.random()
    if isinstance(rng, np.random.Generator):
        return float(rng.random())
    if isinstance(rng, np.random.RandomState):
        return float(rng.standard_normal())
    return torch.rand(1, generator=rng).item()


def _make(kind):
    return {
        "random": lambda: random.Random(1),
        "generator": lambda: np.random.default_rng(1),
        "randomstate": lambda: np.random.RandomState(1),
        "torch": lambda: torch.Generator().manual_seed(1),
    }[kind]()


@pytest.fixture(params=["random", "generator", "randomstate", "torch"])
def rng(request):
    obj = register_rng(_make(request.param), key=f"test-{request.param}")
    yield obj
    unregister_rng(obj)


def test_seeded_inside_and_restored_after(rng):
    fresh = _draw(_clone_state_of(rng))
    with deterministic(seed=3):
        a = [_draw(rng) for _ in range(3)]
    with deterministic(seed=3):
        b = [_draw(rng) for _ in range(3)]
    assert a == b
    assert _draw(rng) == fresh  # the caller's stream continues untouched


def _clone_state_of(rng):
    if isinstance(rng, random.Random):
        clone = random.Random()
        clone.setstate(rng.getstate())
    elif isinstance(rng, np.random.Generator):
        clone = np.random.Generator(type(rng.bit_generator)())
        clone.bit_generator.state = rng.bit_generator.state
    elif isinstance(rng, np.random.RandomState):
        clone = np.random.RandomState()
        clone.set_state(rng.get_state())
    else:
        clone = torch.Generator()
        clone.set_state(rng.get_state())
    return clone


def test_seed_is_derived_from_block_seed_and_key():
    rng = register_rng(random.Random(), key="augment")
    try:
        with deterministic(seed=5):
            inside = rng.random()
        assert inside == random.Random(derive_seed(5, "user", "augment", bits=64)).random()
        with deterministic(seed=6):
            assert rng.random() != inside
    finally:
        unregister_rng(rng)


def test_different_keys_give_different_streams():
    a = register_rng(random.Random(), key="a")
    b = register_rng(random.Random(), key="b")
    try:
        with deterministic(seed=0):
            assert a.random() != b.random()
    finally:
        unregister_rng(a)
        unregister_rng(b)


def test_default_key_is_the_registration_ordinal_and_registration_is_idempotent():
    rng = random.Random()
    assert register_rng(rng) is rng
    register_rng(rng)
    try:
        keys = [k for k, o in registered_rngs() if o is rng]
        assert len(keys) == 1 and keys[0].isdigit()
    finally:
        unregister_rng(rng)


def test_weakly_held_objects_disappear():
    rng = register_rng(random.Random())
    before = len(registered_rngs())
    del rng
    gc.collect()
    assert len(registered_rngs()) == before - 1
    with deterministic(seed=0):
        pass


def test_unmanageable_object_and_bad_key():
    with pytest.raises(TypeError, match=r"cannot manage list.*accepted: random\.Random"):
        register_rng([1, 2])
    with pytest.raises(TypeError, match="key must be a str or None, got int 3"):
        register_rng(random.Random(), key=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not registered"):
        unregister_rng(random.Random())


def test_exact_random_uses_fast_path_and_subclasses_use_their_own_methods():
    class Counting(random.Random):
        seeds: ClassVar[list] = []

        def seed(self, a=None, version=2):
            Counting.seeds.append(a)
            super().seed(a, version)

    fast = register_rng(random.Random(1), key="fast")
    sub = register_rng(Counting(1), key="sub")
    try:
        Counting.seeds.clear()
        with deterministic(seed=2):
            inside_fast, inside_sub = fast.random(), sub.random()
        assert Counting.seeds == [derive_seed(2, "user", "sub", bits=64)]
        assert inside_fast == random.Random(derive_seed(2, "user", "fast", bits=64)).random()
        assert inside_sub == random.Random(derive_seed(2, "user", "sub", bits=64)).random()
    finally:
        unregister_rng(fast)
        unregister_rng(sub)


def test_system_random_is_rejected():
    with pytest.raises(TypeError, match=r"cannot manage random\.SystemRandom"):
        register_rng(random.SystemRandom())
