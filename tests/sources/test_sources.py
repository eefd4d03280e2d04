"""Each source on its own: capture/restore is exact, apply seeds like the classic recipe."""

from __future__ import annotations

import os
import random
import sys
import types

import numpy as np
import pytest
import torch

from deterministic_ctx import DeviceMismatchError, StateWarning, _torch
from deterministic_ctx.base.settings import Settings
from deterministic_ctx.sources import SOURCES, accelerators
from deterministic_ctx.sources.accelerators import (
    LazyAcceleratorSource,
    LazyState,
    LiveState,
    refuse_inside_graph_capture,
)
from deterministic_ctx.sources.environ import EnvironSource
from deterministic_ctx.sources.flags import TorchFlagsSource
from deterministic_ctx.sources.numpy_global import NumpyGlobalSource
from deterministic_ctx.sources.python_random import PythonRandomSource
from deterministic_ctx.sources.rngs.persistence import (
    numpy_state_to_plain,
    random_state_to_plain,
)
from deterministic_ctx.sources.torch_cpu import TorchCPUSource
from tests.helpers import cuda_initialized_after

S0 = Settings(0, False)


def test_every_source_has_a_unique_name():
    names = [s.name for s in SOURCES]
    assert len(names) == len(set(names))
    assert {"random", "numpy", "torch.cpu", "torch.cuda", "torch.flags", "environ", "user"} <= set(
        names
    )


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
def test_python_random_roundtrip_and_seed(fast):
    rng = random.Random(99)
    rng.gauss(0, 1)  # leaves a cached gaussian
    source = PythonRandomSource(rng, fast=fast)
    state = source.capture()
    expected = [rng.gauss(0, 1) for _ in range(3)] + [rng.random()]
    source.apply(S0)
    assert rng.random() == random.Random(0).random()
    source.restore(state)
    assert [rng.gauss(0, 1) for _ in range(3)] + [rng.random()] == expected
    assert "gauss_next" in source.export_state(state)  # the gaussian cache is part of the state


def test_python_random_fast_and_exact_paths_agree():
    rng = random.Random(3)
    rng.random()
    fast, exact = PythonRandomSource(rng), PythonRandomSource(rng, fast=False)
    public = random_state_to_plain(rng.getstate())
    assert fast.export_state(fast.capture()) == public == exact.export_state(exact.capture())


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
def test_numpy_roundtrip_includes_gaussian_cache(fast):
    rs = np.random.RandomState(np.random.MT19937(4))
    rs.standard_normal()  # odd number of gaussians: one is cached
    assert rs.get_state(legacy=False)["has_gauss"] == 1
    source = NumpyGlobalSource(rs, fast=fast)
    state = source.capture()
    expected = rs.standard_normal(5)
    source.apply(S0)
    assert rs.rand() == np.random.RandomState(0).rand()
    source.restore(state)
    np.testing.assert_array_equal(rs.standard_normal(5), expected)


def test_numpy_fast_capture_matches_public_state():
    rs = np.random.RandomState(np.random.MT19937(8))
    rs.standard_normal()
    source = NumpyGlobalSource(rs)
    assert source.export_state(source.capture()) == numpy_state_to_plain(rs.get_state(legacy=False))


def test_numpy_replaced_bit_generator_is_restored_and_block_uses_legacy_mt():
    source = NumpyGlobalSource()
    before = source.capture()
    original = np.random.mtrand._rand._bit_generator
    pcg = np.random.PCG64(1)
    try:
        np.random.set_bit_generator(pcg)
        state = source.capture()
        assert isinstance(state[1], dict)  # exact path for non-MT19937
        source.apply(S0)
        assert np.random.rand() == np.random.RandomState(0).rand()
        source.restore(state)
        assert np.random.mtrand._rand._bit_generator is pcg
    finally:
        source.restore(before)
    assert np.random.mtrand._rand._bit_generator is original


def test_numpy_replaced_bit_generator_draws_continue_exactly():
    source = NumpyGlobalSource()
    before = source.capture()
    try:
        np.random.set_bit_generator(np.random.PCG64(1))
        state = source.capture()
        expected = np.random.rand(3)
        source.restore(state)
        source.apply(S0)
        source.restore(state)
        np.testing.assert_array_equal(np.random.rand(3), expected)
    finally:
        source.restore(before)


def test_torch_cpu_roundtrip_and_seed():
    gen = torch.Generator().manual_seed(5)
    source = TorchCPUSource(gen)
    state = source.capture()
    expected = torch.rand(3, generator=gen)
    source.apply(S0)
    assert torch.equal(
        torch.rand(2, generator=gen), torch.rand(2, generator=torch.Generator().manual_seed(0))
    )
    source.restore(state)
    assert torch.equal(torch.rand(3, generator=gen), expected)


def test_flags_applied_and_restored():
    source = TorchFlagsSource()
    state = source.capture()
    try:
        source.apply(Settings(0, True))
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        if _torch.MKLDNN_DETERMINISTIC.available:  # torch >= 2.5
            assert torch.backends.mkldnn.deterministic
        if _torch.FILL_UNINITIALIZED_MEMORY.available:  # torch >= 2.2
            assert torch.utils.deterministic.fill_uninitialized_memory
    finally:
        source.restore(state)
    assert source.capture() == state


def test_flags_restore_precision_changed_inside():
    source = TorchFlagsSource()
    state = source.capture()
    try:
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.benchmark = True
        torch.use_deterministic_algorithms(True, warn_only=True)
    finally:
        source.restore(state)
    after = source.capture()
    # use_deterministic_algorithms() imports inductor: it stays imported, at its default.
    assert after.inductor_deterministic in (state.inductor_deterministic, False)
    assert after._replace(inductor_deterministic=None) == state._replace(
        inductor_deterministic=None
    )
    assert torch.get_float32_matmul_precision() == state.float32_matmul_precision


def test_flags_never_import_inductor_but_manage_it_when_loaded(monkeypatch):
    source = TorchFlagsSource()
    fake = types.SimpleNamespace(deterministic=False)
    monkeypatch.setitem(sys.modules, "torch._inductor.config", fake)
    state = source.capture()
    source.apply(S0)
    assert fake.deterministic is True
    source.restore(state)
    assert fake.deterministic is False


def test_environ_keeps_valid_cublas_and_restores_absence():
    env: dict[str, str] = {}
    source = EnvironSource(env)
    state = source.capture()
    source.apply(Settings(7, False))
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONHASHSEED": "7"}
    source.restore(state)
    assert env == {}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    env["PYTHONHASHSEED"] = "random"
    state = source.capture()
    source.apply(Settings(7, False))
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    source.restore(state)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "PYTHONHASHSEED": "random"}


def test_environ_replaces_invalid_cublas_inside_only():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":1:1"}
    source = EnvironSource(env)
    state = source.capture()
    source.apply(S0)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    source.restore(state)
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":1:1"


# --- accelerators, with a fake lazily-initialized device module -------------------------------


class FakeDevice:
    """Mimics torch.cuda's lazy initialization, with CPU generators as devices."""

    def __init__(self, devices: int = 2) -> None:
        self._initialized = False
        self._devices = devices
        self._lazy_seed_tracker = type(torch.cuda._lazy_seed_tracker)()
        self._queued_calls: list = []
        self.default_generators: tuple = ()

    def is_initialized(self) -> bool:
        return self._initialized

    def _is_in_bad_fork(self) -> bool:
        return False

    def lazy_init(self) -> None:  # what torch.cuda._lazy_init does
        self.default_generators = tuple(torch.Generator() for _ in range(self._devices))
        for gen in self.default_generators:
            gen.manual_seed(67280421310721)
        self._initialized = True
        calls = list(self._queued_calls) + [c for c in self._lazy_seed_tracker.get_calls() if c]
        for fn, _tb in calls:
            fn()

    def manual_seed_all(self, seed: int) -> None:  # what torch.cuda.manual_seed_all does
        def cb():
            for gen in self.default_generators:
                gen.manual_seed(seed)

        if self._initialized:
            cb()
        else:
            self._lazy_seed_tracker.queue_seed_all(cb, ["stack"])

    def draw(self) -> list[float]:
        return [torch.rand(1, generator=g).item() for g in self.default_generators]


def _fresh_state(index: int) -> torch.Tensor:
    return torch.Generator().manual_seed(67280421310721).get_state()


def _fake_source(dev: FakeDevice) -> LazyAcceleratorSource:
    return LazyAcceleratorSource(dev, "fake", fresh_state=_fresh_state)


def _reference(seed: int | None, devices: int = 2) -> list[float]:
    ref = FakeDevice(devices)
    if seed is not None:
        ref.manual_seed_all(seed)
    ref.lazy_init()
    return ref.draw()


def test_lazy_device_never_initialized_leaves_no_queued_seed():
    dev = FakeDevice()
    source = _fake_source(dev)
    state = source.capture()
    assert isinstance(state, LazyState)
    source.apply(S0)
    assert dev._lazy_seed_tracker.manual_seed_all_cb is not None
    dev.manual_seed_all(5)  # user code queueing its own seed inside the block
    source.restore(state)
    assert dev._lazy_seed_tracker.manual_seed_all_cb is None
    assert dev._lazy_seed_tracker.call_order == []
    assert not dev.is_initialized()


def test_lazy_device_first_initialized_inside_block_starts_from_block_seed():
    dev = FakeDevice()
    source = _fake_source(dev)
    state = source.capture()
    source.apply(Settings(3, False))
    dev.lazy_init()  # first CUDA use happens inside the block
    assert dev.draw() == _reference(3)
    source.restore(state)
    # After exit the generators are what they would have been without the block.
    assert dev.draw() == _reference(None)


def test_lazy_device_user_seed_before_block_survives_initialization_inside():
    dev = FakeDevice()
    dev.manual_seed_all(11)
    source = _fake_source(dev)
    state = source.capture()
    source.apply(S0)
    dev.lazy_init()
    source.restore(state)
    assert dev.draw() == _reference(11)


def test_live_device_roundtrip_and_seed():
    dev = FakeDevice(3)
    dev.lazy_init()
    dev.draw()
    source = _fake_source(dev)
    state = source.capture()
    assert isinstance(state, LiveState) and len(state.states) == 3
    expected = dev.draw()
    source.restore(state)
    source.apply(Settings(2, False))
    assert dev.draw() == [torch.rand(1, generator=torch.Generator().manual_seed(2)).item()] * 3
    source.restore(state)
    assert dev.draw() == expected


def test_live_device_count_mismatch_is_a_clear_error():
    dev = FakeDevice(2)
    dev.lazy_init()
    source = _fake_source(dev)
    state = source.capture()
    dev.default_generators = dev.default_generators[:1]
    with pytest.raises(DeviceMismatchError, match="2 device generator"):
        source.restore(state)


def test_strict_devices_refuses_a_state_saved_before_the_device_was_initialized():
    dev = FakeDevice(2)
    source = _fake_source(dev)
    saved = source.export_state(source.capture())  # never initialized where it was saved
    dev.lazy_init()
    state = source.import_state(saved, "devices.fake", strict=True)
    with pytest.raises(DeviceMismatchError, match=r"before the device was initialized.*strict"):
        source.restore(state)


class FakeMPS:
    """``torch.mps``'s RNG functions over a CPU generator (no MPS device here)."""

    def __init__(self) -> None:
        self.generator = torch.Generator()

    def get_rng_state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def manual_seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def draw(self) -> list[float]:
        return torch.rand(3, generator=self.generator).tolist()


def _mps_source(mps: FakeMPS) -> LazyAcceleratorSource:
    return LazyAcceleratorSource(accelerators._MPSModule(mps), "mps")


def test_mps_roundtrip_and_seed():
    mps = FakeMPS()
    source = _mps_source(mps)
    state = source.capture()
    assert isinstance(state, LiveState) and len(state.states) == 1
    expected = mps.draw()
    source.apply(Settings(4, False))
    assert mps.draw() == torch.rand(3, generator=torch.Generator().manual_seed(4)).tolist()
    source.restore(state)
    assert mps.draw() == expected
    refuse_inside_graph_capture((source,))  # MPS has no graphs: never refused


def test_mps_checkpoint_entry_is_checked_at_load():
    mps = FakeMPS()
    source = _mps_source(mps)
    data = source.export_state(source.capture())
    assert data["initialized"] is True and len(data["states"]) == 1
    expected = mps.draw()
    source.restore(source.import_state(data, "devices.mps", strict=True))
    assert mps.draw() == expected
    size = mps.get_rng_state().numel()
    wrong = {"initialized": True, "states": [torch.zeros(16, dtype=torch.uint8)]}
    with pytest.raises(
        ValueError, match=rf"devices\.mps\.states\[0\]: expected {size} bytes, got 16"
    ):
        source.import_state(wrong, "devices.mps")
    # No entry (saved where there was no MPS): a device mismatch, at load.
    with pytest.warns(StateWarning, match=r"0 torch.mps generator state\(s\), this process has 1"):
        assert source.import_state(None, "devices.mps") is None
    with pytest.raises(ValueError, match=r"strict_devices=True"):
        source.import_state({"initialized": False, "states": []}, "devices.mps", strict=True)
    two = {"initialized": True, "states": data["states"] * 2}
    with pytest.warns(StateWarning, match="restoring the first 1"):
        loaded = source.import_state(two, "devices.mps")
    assert loaded is not None and len(loaded.states) == 1


def test_mps_is_a_source_where_the_build_has_it(monkeypatch):
    monkeypatch.setattr(accelerators, "HAS_MPS", True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    (mps,) = [s for s in accelerators.accelerator_sources() if s.device_type == "mps"]
    assert mps.name == "torch.mps" and not mps.applies_nothing


def test_real_cuda_module_is_never_initialized_by_sources():
    # In a fresh interpreter: see cuda_initialized_after.
    assert not cuda_initialized_after("""
        from deterministic_ctx.base.settings import Settings
        from deterministic_ctx.sources import SOURCES

        (cuda,) = [source for source in SOURCES if source.name == "torch.cuda"]
        state = cuda.capture()
        cuda.apply(Settings(0, False))
        cuda.restore(state)
    """)


def test_flags_capture_survives_a_raising_matmul_precision_getter(monkeypatch):
    import deterministic_ctx.sources.precision as precision_module

    def raising():
        raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(precision_module, "get_float32_matmul_precision", raising)
    source = TorchFlagsSource()
    state = source.capture()
    assert state.float32_matmul_precision is None
    source.apply(S0)
    source.restore(state)  # restores through the per-op entries, never raises
    with pytest.raises(ValueError, match="cannot be saved"):
        source.export_state(state)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
def test_numpy_fast_seeding_equals_legacy_seed(seed):
    fast_rs = np.random.RandomState(np.random.MT19937(3))
    fast_rs.standard_normal()  # a cached gaussian that seeding must clear
    exact_rs = np.random.RandomState(np.random.MT19937(3))
    exact_rs.standard_normal()
    NumpyGlobalSource(fast_rs).apply(Settings(seed, False))
    NumpyGlobalSource(exact_rs, fast=False).apply(Settings(seed, False))
    fast, exact = fast_rs.get_state(legacy=False), exact_rs.get_state(legacy=False)
    np.testing.assert_array_equal(fast["state"]["key"], exact["state"]["key"])
    assert (fast["state"]["pos"], fast["has_gauss"], fast["gauss"]) == (
        exact["state"]["pos"],
        exact["has_gauss"],
        exact["gauss"],
    )
    assert fast_rs.standard_normal(3).tolist() == exact_rs.standard_normal(3).tolist()


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_torch_cpu_cached_seeding_equals_manual_seed(seed):
    fast, exact = torch.Generator(), torch.Generator()
    torch.randn(3, generator=fast)
    TorchCPUSource(fast).apply(Settings(seed, False))
    exact.manual_seed(seed)
    assert fast.initial_seed() == exact.initial_seed() == seed
    assert torch.equal(fast.get_state(), exact.get_state())
    assert torch.equal(torch.randn(5, generator=fast), torch.randn(5, generator=exact))


def test_environ_fast_reader_agrees_with_os_environ(monkeypatch):
    from deterministic_ctx.base.fast_paths import ENABLED
    from deterministic_ctx.sources.environ import _access

    access = _access(os.environ)
    # Proven on this platform, unless DETERMINISTIC_CTX_NO_FAST_PATHS=1 turned it off.
    assert access.fast is ENABLED
    key = access.encodekey("PYTHONHASHSEED")
    for value in ("", ":16:8", "ünïcode"):
        monkeypatch.setenv("PYTHONHASHSEED", value)
        assert access.decode(access.get(key)) == os.environ["PYTHONHASHSEED"] == value
    monkeypatch.delenv("PYTHONHASHSEED")
    assert access.get(key) is None
    assert not _access({}).fast  # any other mapping: the public API


def test_a_random_subclass_seeds_with_its_own_seed_and_not_into_the_shared_cache():
    # A subclass's seed() may differ from random.Random's: it runs, and its
    # result never becomes the record a later block writes into ``random``.
    import random

    from deterministic_ctx import deterministic
    from deterministic_ctx.base.settings import Settings
    from deterministic_ctx.sources.python_random import PythonRandomSource

    class Shifted(random.Random):
        def seed(self, a=None, version=2):
            super().seed(a + 1000 if isinstance(a, int) else a, version)

    rng = Shifted()
    source = PythonRandomSource(rng=rng)
    state = source.capture()
    source.apply(Settings.build(12345, False))
    assert rng.random() == random.Random(13345).random()
    source.restore(state)
    with deterministic(seed=12345):
        assert random.random() == random.Random(12345).random()
