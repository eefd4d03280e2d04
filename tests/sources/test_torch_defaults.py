"""What a block's body commonly changes besides RNG states: torch's defaults.

``torch.set_default_dtype`` (the same generator state gives other numbers for
float32 and float64), ``torch.set_default_device``, the deprecated
``torch.set_default_tensor_type``, ``torch.set_num_threads`` (it changes CPU
reduction results) and ``torch.set_flush_denormal``: a block never chooses
them, but restores them on exit, and a snapshot saves and loads them.  Also
NumPy's ``set_bit_generator`` inside a block, which the NumPy source covers.

Every test puts back what it changes itself (``_defaults_kept``): the suite's
leak guard does not look at these defaults.
"""

from __future__ import annotations

import importlib
import io
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deterministic_ctx import InvalidSnapshotError, Snapshot, _torch, deterministic
from deterministic_ctx.state import checkpoint
from tests.helpers import default_device

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _module() -> Any:
    # Imported per test, so that each test fails on its own where the module is missing.
    return importlib.import_module("deterministic_ctx.sources.torch_defaults")


#: torch 2.1 keeps the default device context in a module global (``None`` until
#: set), later torch per thread, in a ``threading.local``.
_PER_THREAD = isinstance(torch._GLOBAL_DEVICE_CONTEXT, threading.local)
needs_per_thread_device = pytest.mark.skipif(
    not _PER_THREAD,
    reason=f"torch {torch.__version__} keeps one default device per process "
    "(torch._GLOBAL_DEVICE_CONTEXT per thread: torch >= 2.3)",
)


#: What :func:`_context` reads where set_default_device was never called.
_NEVER_SET = "absent" if _PER_THREAD else None


def _context() -> Any:
    """What ``torch.set_default_device`` installed in this thread (a sentinel when nothing)."""
    if not _PER_THREAD:
        return torch._GLOBAL_DEVICE_CONTEXT
    return torch._GLOBAL_DEVICE_CONTEXT.__dict__.get("device_context", "absent")


def _mode_stack() -> list[Any]:
    return list(torch.overrides._get_current_function_mode_stack())


def _flushes() -> bool:
    # A denormal float64 survives a multiplication by one only when denormals are kept.
    return (torch.tensor([1e-310], dtype=torch.float64, device="cpu") * 1.0).item() == 0.0


@contextmanager
def _defaults_kept() -> Iterator[None]:
    """Put every default back by hand, whatever the test (or the code under test) did."""
    import torch.utils._device as device_module

    dtype, threads, flush = torch.get_default_dtype(), torch.get_num_threads(), _flushes()
    context, current = _context(), device_module.CURRENT_DEVICE
    try:
        yield
    finally:
        now = _context()
        if now not in ("absent", None) and now is not context:
            try:
                torch.set_default_device(None)
            except AssertionError:  # the mode stack was left in disorder: empty it
                while _mode_stack():
                    torch.overrides._pop_mode()
        if not _PER_THREAD:
            torch._GLOBAL_DEVICE_CONTEXT = context
        elif context == "absent":
            torch._GLOBAL_DEVICE_CONTEXT.__dict__.pop("device_context", None)
        device_module.CURRENT_DEVICE = current
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.set_flush_denormal(flush)


@pytest.fixture(autouse=True)
def _kept() -> Iterator[None]:
    with _defaults_kept():
        yield


def _other_thread_count() -> int:
    return 1 if torch.get_num_threads() != 1 else 2


# -- a block restores each default ---------------------------------------------


def test_the_source_is_registered():
    from deterministic_ctx.sources import SOURCES

    names = [s.name for s in SOURCES]
    assert "torch.defaults" in names
    assert names.index("torch.defaults") > names.index("torch.flags")
    assert "torch.defaults" in Snapshot.capture().sources


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_block_restores_the_default_dtype(dtype):
    outside = torch.float64 if dtype != torch.float64 else torch.float32
    torch.set_default_dtype(outside)
    with deterministic(seed=0):
        torch.set_default_dtype(dtype)
        assert torch.empty(2).dtype == dtype
    assert torch.get_default_dtype() == outside
    assert torch.empty(2).dtype == outside


def test_block_leaves_the_callers_dtype_in_force_inside():
    # A block does not choose the dtype: float64 draws stay float64 draws, seeded as usual.
    torch.set_default_dtype(torch.float64)
    with deterministic(seed=3):
        inside = torch.rand(3)
    expected = torch.rand(3, generator=torch.Generator().manual_seed(3))  # torch.manual_seed(3)
    assert inside.dtype == torch.float64 and torch.equal(inside, expected)


def test_block_restores_an_absent_default_device_as_absent():
    assert _context() == _NEVER_SET
    stack = _mode_stack()
    with deterministic(seed=0):
        torch.set_default_device("meta")
        assert torch.empty(2).device.type == "meta"
    assert _context() == _NEVER_SET
    assert _mode_stack() == stack
    assert torch.empty(2).device.type == "cpu"


@needs_per_thread_device  # torch 2.1: "never set" is None
def test_block_restores_an_absent_default_device_after_set_default_device_none():
    with deterministic(seed=0):
        torch.set_default_device(None)
        assert _context() is None
    assert _context() == _NEVER_SET


def test_block_restores_the_callers_device_context_object():
    import torch.utils._device as device_module

    torch.set_default_device("meta")
    context = _context()
    stack = _mode_stack()
    with deterministic(seed=0):
        assert torch.empty(1).device.type == "meta"  # the caller's default is in force inside
        torch.set_default_device("cpu")
        assert torch.empty(1).device.type == "cpu"
    assert _context() is context  # the same object, not an equal one
    assert _mode_stack() == stack and stack[0] is context
    assert torch.device("meta") == device_module.CURRENT_DEVICE
    assert torch.empty(1).device.type == "meta"
    with deterministic(seed=0):
        torch.set_default_device(None)
    assert _context() is context and _mode_stack() == stack


def test_default_device_under_a_device_context_manager():
    # ``with torch.device(...)`` is scoped, not a default: the block leaves it alone,
    # and what set_default_device did inside is undone around it.
    with torch.device("meta"):
        stack = _mode_stack()
        with deterministic(seed=0):
            torch.set_default_device("cpu")
        assert _mode_stack() == stack
        assert torch.empty(1).device.type == "meta"
    assert torch.empty(1).device.type == "cpu"


@needs_per_thread_device
def test_default_device_is_per_thread_and_restored_in_the_blocks_thread():
    seen: list[Any] = []

    def worker() -> None:
        with deterministic(seed=0):
            torch.set_default_device("meta")
            seen.append(_context() == "absent")  # the main thread's is not this one's
        seen.append(_context())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [False, "absent"]
    assert _context() == _NEVER_SET


def test_block_restores_the_number_of_threads():
    before = torch.get_num_threads()
    with deterministic(seed=0):
        torch.set_num_threads(_other_thread_count())
    assert torch.get_num_threads() == before


def test_block_restores_flush_denormal():
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    with deterministic(seed=0):
        torch.set_flush_denormal(True)
        assert _flushes()
    assert not _flushes()
    torch.set_flush_denormal(True)
    with deterministic(seed=0):
        torch.set_flush_denormal(False)
    assert _flushes()


def test_block_restores_the_legacy_default_tensor_type():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # deprecated since torch 2.1
        with deterministic(seed=0):
            torch.set_default_tensor_type(torch.DoubleTensor)
            assert torch.tensor([1.5]).dtype == torch.float64
    assert torch.get_default_dtype() == torch.float32


def test_legacy_cuda_tensor_type_is_restored_through_torch(monkeypatch):
    # No CUDA here: fake the legacy getter and setter, check what the source asks torch for.
    mod = _module()
    current = {"device": "cpu"}
    calls: list[Any] = []
    monkeypatch.setattr(mod, "_TENSOR_TYPE_DEVICES_VARY", True)  # as on a CUDA build
    monkeypatch.setattr(mod, "_get_tensor_type", lambda: current["device"])
    monkeypatch.setattr(mod, "_set_tensor_type", lambda cls: calls.append(cls))
    source = mod.TorchDefaultsSource()
    state = source.capture()
    current["device"] = "cuda"  # as torch.set_default_tensor_type(torch.cuda.HalfTensor) leaves it
    source.restore(state)
    assert calls == [torch.FloatTensor]


def test_nothing_is_written_when_nothing_changed(monkeypatch):
    mod = _module()

    def refuse(*args: Any) -> None:
        raise AssertionError("written although nothing changed")

    for name in ("_set_dtype", "_set_tensor_type", "_set_threads", "_set_flush"):
        monkeypatch.setattr(mod, name, refuse)
    torch.set_default_device("meta")
    source = mod.TorchDefaultsSource()
    state = source.capture()
    source.apply(None)  # applies nothing: a block does not choose these
    source.restore(state)
    source.restore(state)
    assert _context() is state[mod.DEVICE_CONTEXT]


def test_a_failing_device_restore_does_not_stop_the_other_defaults(monkeypatch):
    mod = _module()
    source = mod.TorchDefaultsSource()
    state = source.capture()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(_other_thread_count())
    torch.set_default_device("meta")

    def broken() -> list[Any]:
        raise RuntimeError("mode stack in disorder")

    monkeypatch.setattr(mod, "_mode_stack", broken)
    with pytest.raises(RuntimeError, match="mode stack in disorder"):
        source.restore(state)
    assert torch.get_default_dtype() == torch.float32
    assert torch.get_num_threads() == state[mod.THREADS]
    monkeypatch.undo()
    source.restore(state)  # and a second run finishes the job
    assert _context() == _NEVER_SET and _mode_stack() == []


def test_a_restore_interrupted_after_exiting_the_bodys_context_finishes_once():
    mod = _module()
    source = mod.TorchDefaultsSource()
    state = source.capture()
    torch.set_default_device("meta")
    _context().__exit__(None, None, None)  # as if interrupted right after this step
    source.restore(state)
    assert _context() == _NEVER_SET and _mode_stack() == []


def test_a_restore_interrupted_after_entering_the_callers_context_finishes_once():
    mod = _module()
    torch.set_default_device("meta")
    source = mod.TorchDefaultsSource()
    state = source.capture()
    context = state[mod.DEVICE_CONTEXT]
    torch.set_default_device(None)
    context.__enter__()  # as if interrupted right after this step
    source.restore(state)
    assert _context() is context
    # prev_mode: the mode below it (torch 2.1's modes have no such attribute).
    assert _mode_stack() == [context] and getattr(context, "prev_mode", None) is None
    assert torch.empty(1).device.type == "meta"


def test_snapshot_restores_repeatedly_and_across_changes():
    torch.set_default_device("meta")
    snap = Snapshot.capture()
    context = _context()
    for device in ("cpu", None, "meta"):
        torch.set_default_device(device)
        torch.set_default_dtype(torch.float64)
        snap.restore()
        assert _context() is context
        assert torch.get_default_dtype() == torch.float32


def test_old_torch_device_layout(monkeypatch):
    # torch < 2.3 kept the context in a module global, not a threading.local.
    mod = _module()
    fake = type("FakeTorch", (), {"_GLOBAL_DEVICE_CONTEXT": None})()
    source = mod.TorchDefaultsSource(holder=fake)
    state = source.capture()
    from torch.utils._device import DeviceContext

    ctx = DeviceContext("meta")
    ctx.__enter__()
    fake._GLOBAL_DEVICE_CONTEXT = ctx  # what the old set_default_device did
    try:
        assert torch.empty(1).device.type == "meta"
        source.restore(state)
        assert fake._GLOBAL_DEVICE_CONTEXT is None
        assert torch.empty(1).device.type == "cpu"
        fake._GLOBAL_DEVICE_CONTEXT = ctx2 = DeviceContext("meta")
        ctx2.__enter__()
        state = source.capture()
        assert state[mod.DEVICE_CONTEXT] is ctx2
        source.restore(state)
        assert torch.empty(1).device.type == "meta"
    finally:
        if any(mode in (ctx, fake._GLOBAL_DEVICE_CONTEXT) for mode in _mode_stack()):
            fake._GLOBAL_DEVICE_CONTEXT.__exit__(None, None, None)


# -- NumPy's bit generator -------------------------------------------------------


def _bg_state(bit_generator: Any) -> str:
    return repr(bit_generator.state)  # arrays included, element by element


def test_set_bit_generator_inside_a_block_is_undone_object_and_state():
    installed = np.random.get_bit_generator()
    state = _bg_state(installed)
    with deterministic(seed=0):
        replacement = np.random.PCG64(7)
        np.random.set_bit_generator(replacement)
        assert np.random.get_bit_generator() is replacement
        np.random.rand(3)
    assert np.random.get_bit_generator() is installed
    assert _bg_state(installed) == state


def test_set_bit_generator_outside_a_block_is_kept_around_it():
    installed = np.random.get_bit_generator()
    pcg = np.random.PCG64(5)
    np.random.set_bit_generator(pcg)
    try:
        state = _bg_state(pcg)
        with deterministic(seed=0):
            np.random.set_bit_generator(np.random.SFC64(1))
        assert np.random.get_bit_generator() is pcg
        assert _bg_state(pcg) == state
    finally:
        np.random.set_bit_generator(installed)


# -- persistence ------------------------------------------------------------------


def _entry(state_dict: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = state_dict["sources"]["torch.defaults"]
    return entry


def test_state_dict_entry():
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    entry = _entry(Snapshot.capture().state_dict())
    assert entry == {
        "dtype": "float64",
        "device": "meta",
        "tensor_type": "cpu",
        "threads": torch.get_num_threads(),
        "flush_denormal": _flushes(),
    }
    torch.set_default_device(None)
    assert "device" not in _entry(Snapshot.capture().state_dict())


@pytest.mark.parametrize("via", ["state_dict", "torch.load", "file"])
def test_round_trip(via, tmp_path):
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    threads = torch.get_num_threads()
    snap = Snapshot.capture()
    saved = snap.state_dict()

    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_num_threads(_other_thread_count())
    if via == "file":
        snap.save(tmp_path / "rng.snap")
    elif via == "torch.load":
        buf = io.BytesIO()
        torch.save({"rng": saved}, buf)

    if via == "file":
        loaded = Snapshot.load(tmp_path / "rng.snap")
    elif via == "torch.load":
        buf.seek(0)
        loaded = Snapshot.from_state_dict(torch.load(buf, weights_only=True)["rng"])
    else:
        loaded = Snapshot.from_state_dict(saved)
    assert "torch.defaults" in loaded.sources
    assert _entry(loaded.state_dict()) == _entry(saved)
    loaded.restore()
    assert torch.get_default_dtype() == torch.float64
    assert _torch.default_device() == torch.device("meta")
    assert torch.get_num_threads() == threads
    context = _context()
    loaded.restore()  # again: the device context it installed is kept, not rebuilt
    assert _context() is context


def test_loaded_flush_denormal_is_restored():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    saved = Snapshot.capture().state_dict()
    assert _entry(saved)["flush_denormal"] is True
    torch.set_flush_denormal(False)
    Snapshot.from_state_dict(saved).restore()
    assert _flushes()


def _old_format(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A state dict as deterministic-ctx wrote it before this source existed."""
    old = {**state_dict, "sources": dict(state_dict["sources"])}
    del old["sources"]["torch.defaults"]
    return old


@pytest.mark.parametrize("via", ["state_dict", "file"])
def test_old_format_without_the_entry_still_loads_and_leaves_defaults_alone(via, tmp_path):
    old = _old_format(Snapshot.capture().state_dict())
    if via == "file":
        path = tmp_path / "old.snap"
        checkpoint.write(path, checkpoint.encode(old))
        loaded = Snapshot.load(path)
    else:
        loaded = Snapshot.from_state_dict(old)
    assert "torch.defaults" not in loaded.sources
    assert "random" in loaded.sources
    torch.set_default_dtype(torch.float64)
    loaded.restore()
    assert torch.get_default_dtype() == torch.float64  # left alone
    assert "torch.defaults" not in loaded.state_dict()["sources"]


_BAD: list[tuple[str, Any, str]] = [
    ("dtype", "int32", r"sources\.torch\.defaults\.dtype: expected one of"),
    ("dtype", "complex64", r"sources\.torch\.defaults\.dtype: expected one of"),
    ("dtype", "float8_e4m3fn", r"sources\.torch\.defaults\.dtype: expected one of"),
    ("dtype", "torch.float32", r"sources\.torch\.defaults\.dtype: expected one of"),
    ("dtype", 32, r"sources\.torch\.defaults\.dtype: expected"),
    ("device", "gpu", r"sources\.torch\.defaults\.device: torch cannot parse"),
    ("device", "cuda:-1", r"sources\.torch\.defaults\.device: torch cannot parse"),
    ("device", "", r"sources\.torch\.defaults\.device: torch cannot parse"),
    ("device", "cpu\x00", r"sources\.torch\.defaults\.device: expected a string"),
    ("device", 0, r"sources\.torch\.defaults\.device: expected a string"),
    ("device", "CPU", r"sources\.torch\.defaults\.device: torch cannot parse"),
    ("threads", 0, r"sources\.torch\.defaults\.threads: expected an int in 1 \.\. 4096"),
    ("threads", -2, r"sources\.torch\.defaults\.threads: expected an int in 1 \.\. 4096"),
    ("threads", 10**6, r"sources\.torch\.defaults\.threads: expected an int in 1 \.\. 4096"),
    ("threads", True, r"sources\.torch\.defaults\.threads: expected an int"),
    ("threads", 2.0, r"sources\.torch\.defaults\.threads: expected an int"),
    ("flush_denormal", 1, r"sources\.torch\.defaults\.flush_denormal: expected True or False"),
    ("tensor_type", "xla", r"sources\.torch\.defaults\.tensor_type: expected one of"),
    ("later", 1, r"sources\.torch\.defaults: unexpected field"),
]


@pytest.mark.parametrize(("field", "value", "message"), _BAD, ids=lambda v: repr(v)[:30])
def test_bad_values_are_rejected_naming_the_field(field, value, message, tmp_path):
    state = Snapshot.capture().state_dict()
    _entry(state)[field] = value
    with pytest.raises(InvalidSnapshotError, match=message):
        Snapshot.from_state_dict(state)
    path = tmp_path / "bad.snap"  # the same through a file
    checkpoint.write(path, checkpoint.encode(state))
    with pytest.raises(InvalidSnapshotError, match=message):
        Snapshot.load(path)
    # The source's own reader raises ValueError naming the field.
    with pytest.raises(ValueError, match=message.replace(r"sources\.", "", 1)):
        _module().TorchDefaultsSource().import_state(_entry(state), "torch.defaults")


@pytest.mark.parametrize("field", ["dtype", "threads", "flush_denormal", "tensor_type"])
def test_a_missing_field_is_rejected(field):
    state = Snapshot.capture().state_dict()
    del _entry(state)[field]
    with pytest.raises(InvalidSnapshotError, match=rf"torch\.defaults: missing field\(s\) {field}"):
        Snapshot.from_state_dict(state)


def test_an_entry_that_is_not_a_dict_is_rejected():
    state = Snapshot.capture().state_dict()
    state["sources"]["torch.defaults"] = ["float32"]
    with pytest.raises(InvalidSnapshotError, match=r"sources\.torch\.defaults: expected a dict"):
        Snapshot.from_state_dict(state)


def test_a_cuda_tensor_type_without_cuda_is_rejected():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    state = Snapshot.capture().state_dict()
    _entry(state)["tensor_type"] = "cuda"
    with pytest.raises(InvalidSnapshotError, match=r"tensor_type: .*CUDA is not available"):
        Snapshot.from_state_dict(state)


def test_a_device_string_is_accepted_in_every_form_torch_writes():
    mod = _module()
    source = mod.TorchDefaultsSource()
    base = _entry(Snapshot.capture().state_dict())
    for device in ("cpu", "meta", "cuda", "cuda:1"):
        state = source.import_state({**base, "device": device}, "torch.defaults")
        assert str(state[mod.DEVICE_CONTEXT].device) == device
    # No device: the loaded snapshot leaves none set, as a thread that never set one.
    context = source.import_state({**base, "device": None}, "torch.defaults")[mod.DEVICE_CONTEXT]
    assert context is mod._ABSENT


_defaults_ops = st.lists(
    st.one_of(
        st.tuples(st.just("dtype"), st.sampled_from(_DTYPES)),
        st.tuples(st.just("device"), st.sampled_from([None, "cpu", "meta"])),
        st.tuples(st.just("threads"), st.integers(1, 3)),
    ),
    max_size=6,
)


def _apply_ops(ops: list[tuple[str, Any]]) -> None:
    for what, value in ops:
        if what == "dtype":
            torch.set_default_dtype(value)
        elif what == "device":
            torch.set_default_device(value)
        else:
            torch.set_num_threads(value)


def _defaults() -> tuple[Any, ...]:
    return (
        torch.get_default_dtype(),
        default_device(),
        torch.get_num_threads(),
        len(_mode_stack()),
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(before=_defaults_ops, inside=_defaults_ops, after=_defaults_ops)
def test_blocks_and_loaded_snapshots_restore_any_sequence(before, inside, after):
    with _defaults_kept():
        _apply_ops(before)
        expected = _defaults()
        with deterministic(seed=0):
            _apply_ops(inside)
        assert _defaults() == expected
        saved = Snapshot.capture().state_dict()
        _apply_ops(after)
        Snapshot.from_state_dict(saved).restore()
        assert _defaults() == expected


def test_the_file_format_documents_the_entry():
    doc = checkpoint.__doc__ or ""
    assert '"torch.defaults"' in doc


def test_denormal_probe_constants_are_what_the_cpu_computes_without_flushing():
    mod = _module()
    assert not _flushes()
    assert mod._SMALLEST_DENORMAL * mod._DAZ_FACTOR == mod.KEPT_DAZ_PROBE == 2.0**-74
    kept = mod._SMALLEST_NORMAL * mod._FTZ_FACTOR
    assert 0.0 < kept < mod._SMALLEST_NORMAL  # a denormal result
    assert kept * mod._FTZ_RESCALE == mod.KEPT_FTZ_PROBE
    assert mod.KEPT_FTZ_PROBE > mod._SMALLEST_NORMAL  # compared as a normal number
    state = mod.TorchDefaultsSource().capture()
    assert (state[mod.DAZ_PROBE], state[mod.FTZ_PROBE]) == (mod.KEPT_DAZ_PROBE, mod.KEPT_FTZ_PROBE)
    if torch.set_flush_denormal(True):
        state = mod.TorchDefaultsSource().capture()
        assert (state[mod.DAZ_PROBE], state[mod.FTZ_PROBE]) == (0.0, 0.0)


def test_a_partial_denormal_mode_is_named_not_saved(monkeypatch):
    mod = _module()
    source = mod.TorchDefaultsSource()
    state = source.capture()
    partial = (*state[: mod.DAZ_PROBE], mod.KEPT_DAZ_PROBE, 0.0)  # FTZ without DAZ
    with pytest.raises(ValueError, match=r"results \(FTZ\) but not denormal inputs \(DAZ\)"):
        source.export_state(partial)
    with pytest.raises(ValueError, match="can only set both or neither"):
        source.restore(partial)
    source.restore(state)  # nothing was changed


def test_a_loaded_snapshot_restore_is_a_compare_once_applied():
    # After the first restore, a loaded state equals what capture reads.
    mod = _module()
    source = mod.TorchDefaultsSource()
    torch.set_default_device("meta")
    loaded = source.import_state(source.export_state(source.capture()), "torch.defaults")
    source.restore(loaded)
    assert source.capture() == loaded


def test_the_tensor_type_device_is_read_only_where_it_can_vary():
    mod = _module()
    assert torch.backends.cuda.is_built() == mod._TENSOR_TYPE_DEVICES_VARY
    assert mod.TorchDefaultsSource().capture()[mod.TENSOR_TYPE] == torch._C._get_default_device()


def test_a_decorated_generator_keeps_its_own_defaults_across_yields():
    from deterministic_ctx import reproducible

    @reproducible(seed=0)
    def gen():
        torch.set_default_dtype(torch.float64)
        while True:
            yield torch.get_default_dtype()

    g = gen()
    assert next(g) == torch.float64
    assert torch.get_default_dtype() == torch.float32  # swapped out at the yield
    torch.set_num_threads(_other_thread_count())  # the caller's change stays the caller's
    threads = torch.get_num_threads()
    assert next(g) == torch.float64
    assert torch.get_num_threads() == threads
    g.close()
    assert torch.get_default_dtype() == torch.float32


def test_flushing_denormals_on_a_cpu_that_cannot_is_rejected_at_load(monkeypatch):
    mod = _module()
    state = Snapshot.capture().state_dict()
    _entry(state)["flush_denormal"] = True
    calls: list[bool] = []
    monkeypatch.setattr(mod, "_set_flush", lambda on: calls.append(on) or False)
    with pytest.raises(InvalidSnapshotError, match=r"flush_denormal: .*cannot on this CPU"):
        Snapshot.from_state_dict(state)
    assert calls == [False]  # asked without changing the mode
    _entry(state)["flush_denormal"] = False
    Snapshot.from_state_dict(state)  # keeping denormals needs nothing
