"""flags=False and fill_uninitialized_memory=False: blocks that apply only what is asked."""

from __future__ import annotations

import os

import pytest
import torch

from deterministic_ctx import Snapshot, _torch, deterministic, reproducible, seed_everything
from tests._oracle import World
from tests.helpers import draw, needs

#: A block's ``fill_uninitialized_memory=False`` needs the flag (torch >= 2.2).
needs_fill = needs(_torch.FILL_UNINITIALIZED_MEMORY)


def test_flags_false_seeds_and_isolates_but_keeps_the_callers_flags(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with deterministic(seed=4):
        expected = draw()
    before = World.now()
    with deterministic(seed=4, flags=False):
        assert draw() == expected  # seeded exactly as with flags
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert "PYTHONHASHSEED" not in os.environ
        torch.use_deterministic_algorithms(True)  # still captured and restored
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    assert World.now() == before


@needs_fill
def test_fill_uninitialized_memory_false_is_the_value_in_the_block():
    assert torch.utils.deterministic.fill_uninitialized_memory
    with deterministic(seed=0, fill_uninitialized_memory=False) as block:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    assert torch.utils.deterministic.fill_uninitialized_memory
    assert repr(block) == "deterministic(seed=0, warn_only=False, fill_uninitialized_memory=False)"
    assert block.flags and not block.fill_uninitialized_memory


@needs_fill
def test_nested_blocks_each_apply_their_own_options():
    with deterministic(seed=0):
        with deterministic(seed=1, flags=False):
            assert torch.are_deterministic_algorithms_enabled()  # the outer block's, kept
        with deterministic(seed=1, fill_uninitialized_memory=False):
            assert not torch.utils.deterministic.fill_uninitialized_memory
        assert torch.utils.deterministic.fill_uninitialized_memory
    assert not torch.are_deterministic_algorithms_enabled()


@needs_fill
def test_reproducible_and_seed_everything_take_the_options():
    @reproducible(seed=3, flags=False)
    def inside():
        return torch.are_deterministic_algorithms_enabled(), torch.rand(1).item()

    assert inside() == inside() and inside()[0] is False
    snap = Snapshot.capture()
    try:
        seed_everything(3, fill_uninitialized_memory=False)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    finally:
        snap.restore()


@pytest.mark.parametrize("name", ["flags", "fill_uninitialized_memory"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_values_are_refused_by_name(name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        deterministic(0, **{name: value})
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        reproducible(seed=0, **{name: value})
    with pytest.raises(TypeError, match=f"{name} must be True or False"):
        seed_everything(0, **{name: value})


@pytest.mark.skipif(
    _torch.FILL_UNINITIALIZED_MEMORY.available, reason="this torch has the flag: see above"
)
def test_fill_uninitialized_memory_false_on_a_torch_without_the_flag_is_refused():
    # Where it is written, naming the torch version that has the flag.
    with pytest.raises(_torch.TorchFeatureError, match=r"fill_uninitialized_memory=False.*2\.2"):
        deterministic(seed=0, fill_uninitialized_memory=False)
    with deterministic(seed=0):  # the default: the flag is off here, the block works
        assert torch.are_deterministic_algorithms_enabled()
