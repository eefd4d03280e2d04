"""Hypothesis properties: the laws the library promises."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deterministic_ctx import Snapshot, deterministic
from tests._oracle import World
from tests.helpers import draw

seeds = st.integers(0, 2**32 - 1)


def _op(name: str, value: int) -> None:
    if name == "random":
        random.random()
    elif name == "gauss":
        random.gauss(0, 1)
    elif name == "np":
        np.random.rand(value % 5 + 1)
    elif name == "np_gauss":
        np.random.randn()
    elif name == "torch":
        torch.rand(value % 7 + 1)
    elif name == "reseed_random":
        random.seed(value)
    elif name == "reseed_np":
        np.random.seed(value)
    elif name == "reseed_torch":
        torch.manual_seed(value)
    elif name == "flags":
        torch.use_deterministic_algorithms(bool(value % 2), warn_only=bool(value % 3 == 0))
        torch.backends.cudnn.benchmark = bool(value % 2)
    elif name == "bitgen":
        np.random.set_bit_generator(np.random.PCG64(value))
    elif name == "block":
        with deterministic(seed=value):
            draw()


ops = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "random",
                "gauss",
                "np",
                "np_gauss",
                "torch",
                "reseed_random",
                "reseed_np",
                "reseed_torch",
                "flags",
                "bitgen",
                "block",
            ]
        ),
        st.integers(0, 2**32 - 1),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_capture_anything_restore_is_identity(operations):
    before = World.now()
    snap = Snapshot.capture()
    try:
        for name, value in operations:
            _op(name, value)
    finally:
        snap.restore()
    assert before.diff(World.now()) == []


@settings(max_examples=40, deadline=None)
@given(seeds, seeds, ops, ops)
def test_nested_blocks_isolate(outer_seed, inner_seed, before_ops, inner_ops):
    with deterministic(seed=outer_seed):
        for name, value in before_ops:
            if name != "bitgen":
                _op(name, value)
        reference = Snapshot.capture()
        expected = [draw() for _ in range(3)]
        reference.restore()
        with deterministic(seed=inner_seed):
            for name, value in inner_ops:
                _op(name, value)
        assert [draw() for _ in range(3)] == expected


@settings(max_examples=30, deadline=None)
@given(seeds, ops)
def test_block_start_is_independent_of_prior_state(seed, prior):
    with deterministic(seed=seed):
        first = [draw() for _ in range(2)]
    snap = Snapshot.capture()
    try:
        for name, value in prior:
            _op(name, value)
        with deterministic(seed=seed):
            assert [draw() for _ in range(2)] == first
    finally:
        snap.restore()
