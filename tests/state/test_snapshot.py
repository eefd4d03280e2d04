"""Snapshot: capture → anything → restore is the identity; immutability; partial failure.

That a test leaves every RNG, flag and managed variable as it found them is checked
after each test by the suite's guard (``tests/conftest.py``), not repeated here.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deterministic_ctx import RestoreError, Snapshot
from deterministic_ctx import sources as sources_module


def _disturb() -> None:
    random.seed(123)
    random.gauss(0, 1)
    np.random.seed(456)
    np.random.randn()  # leaves the legacy gaussian cache set
    torch.manual_seed(789)  # also queues lazy CUDA/XPU/MTIA seeds
    torch.rand(3)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = True


def test_restore_is_identity_after_draws_reseeds_and_flag_changes():
    snap = Snapshot.capture()
    _disturb()
    snap.restore()  # the suite's guard checks that nothing is left behind


def test_restore_can_be_repeated():
    snap = Snapshot.capture()
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    for _ in range(3):
        snap.restore()
        assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected
    snap.restore()


def test_snapshot_is_immutable_and_not_constructible_directly():
    snap = Snapshot.capture()
    with pytest.raises(AttributeError, match="immutable"):
        snap._states = ()  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del snap._states
    with pytest.raises(TypeError, match=r"Snapshot\.capture\(\)"):
        Snapshot()


def test_sources_and_state_of():
    snap = Snapshot.capture()
    assert snap.sources[:3] == ("random", "numpy", "torch.cpu")
    assert "Snapshot(sources=" in repr(snap)
    assert snap.state_of("environ") == snap.state_of("environ")
    with pytest.raises(KeyError, match="no source named 'nope'"):
        snap.state_of("nope")


class _Failing:
    name = "failing"

    def capture(self):
        return None

    def restore(self, state):
        raise OSError("device lost")

    def apply(self, settings):
        pass


def test_one_failing_source_does_not_stop_the_others(monkeypatch):
    monkeypatch.setattr(sources_module, "SOURCES", (*sources_module.SOURCES, _Failing()))
    snap = Snapshot.capture()
    _disturb()
    with pytest.raises(RestoreError, match="failing: OSError") as info:
        snap.restore()
    assert list(info.value.failures) == ["failing"]


class _Interrupting(_Failing):
    name = "interrupting"

    def restore(self, state):
        raise KeyboardInterrupt


def test_keyboard_interrupt_while_restoring_still_restores_the_rest(monkeypatch):
    # Appended last, so it is restored first: every other source comes after it.
    monkeypatch.setattr(sources_module, "SOURCES", (*sources_module.SOURCES, _Interrupting()))
    snap = Snapshot.capture()
    _disturb()
    with pytest.raises(KeyboardInterrupt):
        snap.restore()
