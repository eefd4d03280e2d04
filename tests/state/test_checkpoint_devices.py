"""Checkpoints and device generators: the documented N-saved / M-here policy.

CPU generators stand in for devices (``_FakeDevice``), so every case runs on any machine.
"""

from __future__ import annotations

import struct
import types
import warnings
from typing import Any

import pytest
import torch

import deterministic_ctx.sources as _sources
from deterministic_ctx import InvalidSnapshotError, RestoreError, Snapshot, StateWarning
from deterministic_ctx.core.world import World as Captured
from deterministic_ctx.sources import accelerators
from deterministic_ctx.sources.accelerators import LazyAcceleratorSource, SavedState
from deterministic_ctx.sources.torch_cpu import generator_state_from_plain
from tests.state.checkpoint_helpers import (
    PhiloxDevice,
    PhiloxGenerator,
    fresh_state,
    isolated,
    philox_cuda_sources,
    seal_state,
)


class _FakeDevice:
    """What a lazy device source touches of ``torch.cuda``; CPU generators stand in
    for devices, and ``initialize`` does what torch's ``_lazy_init`` does."""

    def __init__(self, count: int, *, initialized: bool) -> None:
        self.count = count
        self.initialized = initialized
        self.default_generators: tuple[torch.Generator, ...] = ()
        self._lazy_seed_tracker = types.SimpleNamespace(
            manual_seed_all_cb=None, manual_seed_cb=None, call_order=[]
        )
        self._queued_calls: list[Any] = []
        if initialized:
            self.default_generators = tuple(
                torch.Generator().manual_seed(100 + i) for i in range(count)
            )

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int:
        return self.count

    def manual_seed_all(self, seed: int) -> None:
        def cb() -> None:
            for gen in self.default_generators:
                gen.manual_seed(seed)

        if self.initialized:
            cb()
            return
        t = self._lazy_seed_tracker
        t.manual_seed_all_cb = (cb, ["trace"])
        t.call_order = [t.manual_seed_cb, t.manual_seed_all_cb]

    def initialize(self) -> None:
        self.default_generators = tuple(torch.Generator() for _ in range(self.count))
        self.initialized = True
        for calls in self._lazy_seed_tracker.call_order:
            if calls:
                self._queued_calls.append(calls)
        for fn, _trace in self._queued_calls:
            fn()
        self._queued_calls.clear()


def _source(device: _FakeDevice) -> LazyAcceleratorSource:
    return LazyAcceleratorSource(
        device, "fake", fresh_state=lambda i: torch.Generator().get_state()
    )


def _states(device: _FakeDevice) -> list[bytes]:
    return [g.get_state().numpy().tobytes() for g in device.default_generators]


def _saved(count: int) -> tuple[dict[str, Any], list[bytes]]:
    there = _FakeDevice(count, initialized=True)
    source = _source(there)
    return source.export_state(source.capture()), _states(there)


def test_same_device_count_restores_every_generator():
    data, expected = _saved(2)
    assert data["initialized"] is True and len(data["states"]) == 2
    here = _FakeDevice(2, initialized=True)
    source = _source(here)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = source.import_state(data, "devices.fake", strict=True)
    source.restore(state)
    assert _states(here) == expected


@pytest.mark.parametrize(("saved", "here"), [(2, 1), (2, 3), (1, 4)])
def test_device_count_mismatch_restores_those_that_exist_and_warns(saved, here):
    data, expected = _saved(saved)
    device = _FakeDevice(here, initialized=True)
    untouched = _states(device)[saved:]
    source = _source(device)
    with pytest.warns(
        RuntimeWarning, match=rf"{saved} torch.fake generator state\(s\), this process has {here}"
    ) as record:
        state = source.import_state(data, "devices.fake", strict=False)
    assert record[0].filename == __file__  # points at the caller, not into the library
    source.restore(state)
    assert _states(device)[: min(saved, here)] == expected[: min(saved, here)]
    assert _states(device)[saved:] == untouched


def test_device_count_mismatch_is_an_error_when_strict():
    data, _ = _saved(2)
    with pytest.raises(ValueError, match=r"devices.fake: .*2 .* has 1 .*\(strict_devices=True\)"):
        _source(_FakeDevice(1, initialized=True)).import_state(data, "devices.fake", strict=True)


def test_no_device_here_drops_the_saved_generators():
    data, _ = _saved(2)
    with pytest.warns(StateWarning, match="restoring the first 0"):
        assert (
            _source(_FakeDevice(0, initialized=False)).import_state(data, "d", strict=False) is None
        )


def test_saved_generators_wait_for_initialization_and_supersede_queued_seeds():
    data, expected = _saved(2)
    device = _FakeDevice(2, initialized=False)
    source = _source(device)
    device.manual_seed_all(5)  # queued before the restore: superseded by it
    source.restore(source.import_state(data, "devices.fake", strict=True))
    assert accelerators._is_rng_call(device._queued_calls[-1])  # a block drops it on exit
    device.initialize()
    assert _states(device) == expected


def test_a_seed_queued_after_the_restore_wins():
    data, _ = _saved(2)
    device = _FakeDevice(2, initialized=False)
    source = _source(device)
    source.restore(source.import_state(data, "devices.fake", strict=True))
    device.manual_seed_all(7)
    device.initialize()
    assert _states(device) == [torch.Generator().manual_seed(7).get_state().numpy().tobytes()] * 2


def test_a_device_not_initialized_when_saved_keeps_what_is_queued_here():
    there = _FakeDevice(2, initialized=False)
    data = _source(there).export_state(_source(there).capture())
    assert data == {"initialized": False, "states": []}
    device = _FakeDevice(2, initialized=False)
    device.manual_seed_all(3)
    queued = device._lazy_seed_tracker.manual_seed_all_cb
    source = _source(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.restore(source.import_state(data, "devices.fake", strict=True))
    assert device._lazy_seed_tracker.manual_seed_all_cb is queued
    assert device._queued_calls == []


def test_a_device_not_initialized_when_saved_but_in_use_here():
    data = {"initialized": False, "states": []}
    device = _FakeDevice(1, initialized=True)
    before = _states(device)
    source = _source(device)
    with pytest.warns(RuntimeWarning, match="keep their current state"):
        source.restore(source.import_state(data, "devices.fake", strict=False))
    assert _states(device) == before
    strict = source.import_state(data, "devices.fake", strict=True)
    assert isinstance(strict, SavedState)
    with pytest.raises(
        RuntimeError, match=r"before the device was initialized.*strict_devices=True"
    ):
        source.restore(strict)


def test_cuda_states_on_a_machine_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    state = fresh_state()
    state["devices"]["cuda"] = {"initialized": True, "states": [torch.zeros(16, dtype=torch.uint8)]}
    with pytest.warns(
        RuntimeWarning, match=r"1 torch.cuda generator state\(s\), this process has 0"
    ):
        loaded = Snapshot.from_state_dict(state)
    assert "torch.cuda" not in loaded.sources
    with pytest.raises(InvalidSnapshotError, match=r"devices.cuda: .*\(strict_devices=True\)"):
        Snapshot.from_state_dict(state, strict_devices=True)


def test_a_device_type_this_build_lacks():
    state = fresh_state()
    state["devices"]["npu"] = {"initialized": False, "states": []}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Snapshot.from_state_dict(state, strict_devices=True)  # nothing was lost
    state["devices"]["npu"] = {"initialized": True, "states": [torch.zeros(16, dtype=torch.uint8)]}
    with pytest.warns(RuntimeWarning, match="torch.npu"):
        Snapshot.from_state_dict(state)
    with pytest.raises(InvalidSnapshotError, match=r"devices\.npu"):
        Snapshot.from_state_dict(state, strict_devices=True)


def test_a_restore_failure_is_reported_not_skipped():
    data, _ = _saved(1)
    device = _FakeDevice(1, initialized=True)
    source = _source(device)
    state = source.import_state(data, "devices.fake", strict=True)
    device.default_generators = (_Broken(),)  # type: ignore[assignment]
    snap = Captured((source,), (state,))
    with pytest.raises(RestoreError, match=r"torch\.fake"):
        snap.restore()


class _Broken:
    def set_state(self, state: torch.Tensor) -> None:
        raise RuntimeError("the device went away")


# --- Philox generator states (CUDA, XPU): what torch's set_state refuses is refused at load ---


def _philox(seed: int, offset: int) -> torch.Tensor:
    """A CUDA generator state as torch writes it: seed (uint64), offset (int64), native order."""
    offset = offset - (1 << 64) if offset >= 1 << 63 else offset
    raw = bytearray(struct.pack("=Qq", seed, offset))
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


@pytest.fixture
def philox_cuda(monkeypatch: pytest.MonkeyPatch) -> PhiloxDevice:
    """A fake initialized CUDA device of two generators with torch's state rules, in ``SOURCES``."""
    device = PhiloxDevice(2)
    monkeypatch.setattr(_sources, "SOURCES", philox_cuda_sources(device))
    return device


def test_the_fake_philox_generator_refuses_what_torch_refuses():
    gen = PhiloxGenerator(0)
    gen.set_state(_philox(5, 8))
    with pytest.raises(RuntimeError, match="offset must be a multiple of 4"):
        gen.set_state(_philox(9, 6))
    # torch sets the seed and resets the offset before it checks the offset.
    assert gen.get_state().tolist() == _philox(9, 0).tolist()
    with pytest.raises(RuntimeError, match="RNG state is wrong size"):
        gen.set_state(torch.zeros(15, dtype=torch.uint8))


@pytest.mark.parametrize("offset", [1, 2, 3, 6, 2**62 + 2, 2**63 + 1, 2**64 - 1])
def test_a_philox_offset_torch_refuses_is_refused_at_load(philox_cuda, tmp_path, offset):
    """The H100 bug: such a state passed every load check, then restore() failed on it
    after restoring the other sources."""
    saved = Snapshot.capture().state_dict()
    saved["devices"]["cuda"]["states"][1] = _philox(7, offset)
    before = philox_cuda.states()
    with pytest.raises(
        InvalidSnapshotError,
        match=rf"^invalid snapshot state_dict: devices\.cuda\.states\[1\]: the cuda generator's Philox offset is "
        rf"{offset}, not a multiple of 4, which torch refuses to restore",
    ):
        Snapshot.from_state_dict(saved)
    path = tmp_path / "rng.snap"
    path.write_bytes(seal_state(saved))
    with pytest.raises(
        InvalidSnapshotError,
        match=r"^invalid snapshot file '.*rng\.snap': devices\.cuda\.states\[1\]: .*Philox",
    ):
        Snapshot.load(path)
    assert philox_cuda.states() == before


@pytest.mark.parametrize("size", [0, 8, 15, 17, 816])
def test_a_philox_state_of_another_size_is_refused_at_load(philox_cuda, size):
    saved = Snapshot.capture().state_dict()
    saved["devices"]["cuda"]["states"][0] = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(
        InvalidSnapshotError,
        match=rf"devices\.cuda\.states\[0\]: expected a cuda generator state of 16 bytes "
        rf"\(a 64-bit seed, then a 64-bit Philox offset\), got {size}$",
    ):
        Snapshot.from_state_dict(saved)


@pytest.mark.parametrize(
    ("seed", "offset"), [(0, 0), (2**64 - 1, 4), (1, 2**63 - 4), (2**63, 2**63), (3, 2**64 - 4)]
)
def test_every_philox_seed_and_offset_torch_takes_loads_and_restores(philox_cuda, seed, offset):
    """Any 64-bit seed, any offset that is a multiple of 4: past ``2**63 - 1`` too, which
    torch writes as a negative int64 and takes back."""
    with isolated():
        saved = Snapshot.capture().state_dict()
        saved["devices"]["cuda"]["states"][0] = _philox(seed, offset)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Snapshot.from_state_dict(saved, strict_devices=True).restore()
        assert philox_cuda.states()[0] == _philox(seed, offset).numpy().tobytes()


@pytest.mark.parametrize("device", ["cuda", "xpu"])
def test_a_bad_philox_state_is_refused_even_where_the_device_is_absent(device):
    """Checked before the device count is: a file is valid or not wherever it is loaded."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    state = fresh_state()
    state["devices"][device] = {"initialized": True, "states": [_philox(1, 4), _philox(1, 5)]}
    with pytest.raises(
        InvalidSnapshotError,
        match=rf"devices\.{device}\.states\[1\]: the {device} generator's Philox offset is 5",
    ):
        Snapshot.from_state_dict(state)


def test_a_registered_cuda_generator_state_is_checked_like_the_default_ones():
    """A registered RNG on a Philox device: its state is checked by the same rules (a
    stand-in for the generator, whose device this machine lacks)."""
    like = types.SimpleNamespace(device=torch.device("cuda", 0), get_state=lambda: _philox(0, 0))
    assert generator_state_from_plain(_philox(3, 8), "user[0].state.state", like).tolist() == (
        _philox(3, 8).tolist()
    )
    with pytest.raises(
        ValueError, match=r"^user\[0\]\.state\.state: the cuda generator's Philox offset is 9,"
    ):
        generator_state_from_plain(_philox(3, 9), "user[0].state.state", like)
