"""CUDA graph capture: blocks and snapshots refuse inside a capture, work around one.

The decision (see ``deterministic_ctx/sources/accelerators.py``): while the
current stream is capturing a graph, reading or setting a device generator
raises :class:`GraphCaptureError` before anything changes; a block entered
before the capture and left after it works as it is.

The first part runs anywhere: a fake ``torch.cuda`` module whose generators
(with torch's Philox state rules) raise, as torch's do, when touched during a
capture, stands in for the real one in ``SOURCES``.  The ``gpu`` part runs the same scenarios on a real CUDA device,
each in a fresh interpreter (CUDA initialization cannot be undone).
"""

from __future__ import annotations

import random
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import deterministic_ctx.sources as _sources
from deterministic_ctx import RestoreError, Snapshot, deterministic, reproducible
from deterministic_ctx.base.lock import LOCK
from deterministic_ctx.base.settings import Settings
from deterministic_ctx.core import engine as _engine
from deterministic_ctx.sources.accelerators import (
    GraphCaptureError,
    LazyAcceleratorSource,
    LazyState,
    LiveState,
    SavedState,
    refuse_inside_graph_capture,
)
from tests._oracle import World
from tests.core.test_interrupts import _lock_free
from tests.helpers import run_python
from tests.state.checkpoint_helpers import PhiloxGenerator

_FRESH_SEED = 67280421310721  # what the fake's lazy initialization seeds with


class _Generator(PhiloxGenerator):
    """A CUDA generator's stand-in: torch's state rules (a seed and a Philox offset, see
    ``PhiloxGenerator``), and, like ``CUDAGeneratorImpl``, it refuses to be read or set
    during a capture."""

    def __init__(self, device: _GraphDevice) -> None:
        super().__init__(_FRESH_SEED)
        self._device = device

    def _check(self) -> None:
        if self._device.capturing:
            raise RuntimeError("fake torch: cannot touch a generator during capture")

    def get_state(self) -> torch.Tensor:
        self._check()
        return super().get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self._check()
        super().set_state(state)

    def manual_seed(self, seed: int) -> _Generator:
        self._check()
        super().manual_seed(seed)
        return self

    def rand(self) -> float:
        """The next number: the CPU generator's stream of this seed, at this offset (a
        kernel's draw moves the offset on by 4)."""
        cpu = torch.Generator().manual_seed(self.seed)
        for _ in range(self.offset // 4 + 1):
            value = torch.rand(1, generator=cpu).item()
        self.draw(4)
        return value


class _GraphDevice:
    """What a lazy device source touches of ``torch.cuda``, plus
    ``is_current_stream_capturing``: ``capturing`` says whether a capture is
    under way; ``answers`` (if given) scripts the next answers instead."""

    def __init__(self, devices: int = 2, *, initialized: bool = True) -> None:
        self.capturing = False
        self.answers: list[bool] = []
        self.asked = 0
        self._devices = devices
        self._initialized = False
        self._lazy_seed_tracker = type(torch.cuda._lazy_seed_tracker)()
        self._queued_calls: list[Any] = []
        self.default_generators: tuple[_Generator, ...] = ()
        if initialized:
            self.lazy_init()

    def is_initialized(self) -> bool:
        return self._initialized

    def is_current_stream_capturing(self) -> bool:
        self.asked += 1
        return self.answers.pop(0) if self.answers else self.capturing

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return self._devices

    def lazy_init(self) -> None:  # what torch.cuda._lazy_init does
        self.default_generators = tuple(_Generator(self) for _ in range(self._devices))
        self._initialized = True
        calls = list(self._queued_calls) + [c for c in self._lazy_seed_tracker.get_calls() if c]
        for fn, _trace in calls:
            fn()

    def states(self) -> list[bytes]:
        return [PhiloxGenerator.get_state(g).numpy().tobytes() for g in self.default_generators]

    def draw(self) -> list[float]:
        return [g.rand() for g in self.default_generators]

    def tracker(self) -> tuple[Any, ...]:
        t = self._lazy_seed_tracker
        return (t.manual_seed_all_cb, t.manual_seed_cb, tuple(t.call_order))


def _fresh_state(index: int) -> torch.Tensor:
    return PhiloxGenerator(_FRESH_SEED).get_state()


def _source(device: _GraphDevice, device_type: str = "cuda") -> LazyAcceleratorSource:
    return LazyAcceleratorSource(device, device_type, fresh_state=_fresh_state)


def _seeded(seed: int, n: int = 2) -> list[float]:
    return [torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()] * n


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> _GraphDevice:
    """A fake initialized CUDA device in place of ``torch.cuda`` in ``SOURCES``."""
    dev = _GraphDevice()
    dev.draw()  # the caller's stream is somewhere past its start
    sources = tuple(_source(dev) if s.name == "torch.cuda" else s for s in _sources.SOURCES)
    assert sum(s.name == "torch.cuda" for s in sources) == 1
    monkeypatch.setattr(_sources, "SOURCES", sources)
    return dev


def _lock_released() -> bool:
    return LOCK.depth == 0 and _lock_free() and not _engine._active


@pytest.fixture
def untouched() -> Iterator[World]:
    """The real global state before the test, checked after it: the guard in
    conftest does too, but this names the test that broke it."""
    before = World.now()
    yield before
    assert World.now() == before


# --- inside a capture: refused before anything changes ---------------------------------------


def test_block_entered_inside_a_capture_refuses_and_changes_nothing(device, untouched):
    states = device.states()
    device.capturing = True
    with pytest.raises(GraphCaptureError), deterministic(seed=0):
        pytest.fail("the body must not run")
    assert World.now() == untouched  # random, NumPy, torch CPU, flags: nothing was applied
    assert device.states() == states
    assert _lock_released()
    device.capturing = False
    with deterministic(seed=0):  # blocks work again once the capture has ended
        assert device.draw() == _seeded(0)
    assert device.states() == states


def test_the_error_names_what_to_do_instead(device):
    device.capturing = True
    with pytest.raises(GraphCaptureError) as info, deterministic(seed=0):
        pass
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    for part in (
        "torch.cuda",
        "CUDA graph is being captured",
        "before the capture begins",
        "with deterministic(seed=0): g.replay()",
        "seed before the capture",
        "register_generator_state",
        "graphsafe_set_state",
    ):
        assert part in message, part


@pytest.mark.parametrize(("device_type", "graphs"), [("cuda", "CUDA graph"), ("xpu", "XPU graph")])
def test_the_error_names_the_device_type(device_type, graphs):
    dev = _GraphDevice()
    dev.capturing = True
    with pytest.raises(GraphCaptureError, match=f"torch.{device_type}: cannot .* {graphs}"):
        _source(dev, device_type).capture()


def test_decorated_function_called_inside_a_capture_refuses(device, untouched):
    calls = []

    @reproducible(seed=0)
    def body() -> None:
        calls.append(1)

    device.capturing = True
    with pytest.raises(GraphCaptureError):
        body()
    assert calls == []
    assert _lock_released()


def test_nested_block_entered_inside_a_capture_leaves_the_outer_one_intact(device, untouched):
    with deterministic(seed=1):
        random.random(), device.draw()
        inside, states = World.now(), device.states()
        device.capturing = True
        with pytest.raises(GraphCaptureError), deterministic(seed=0):
            pytest.fail("the body must not run")
        device.capturing = False
        assert LOCK.depth == 1  # the outer block's level only
        assert (World.now(), device.states()) == (inside, states)  # the outer block's world
    assert _lock_released()


def test_refusal_half_way_through_the_entry_is_rolled_back(device, untouched):
    # The capture check passes, then seeding the device refuses (a capture
    # begun in between): random, NumPy and torch CPU were already seeded, and
    # the engine's roll-back puts them back.
    states = device.states()
    device.answers = [False, True]  # capture: not capturing; apply: capturing
    with (
        pytest.raises(GraphCaptureError, match="cannot seed the generators"),
        deterministic(seed=0),
    ):
        pytest.fail("the body must not run")
    assert device.answers == []
    assert World.now() == untouched
    assert device.states() == states
    assert _lock_released()


def test_snapshot_capture_inside_a_capture_refuses(device, untouched):
    device.capturing = True
    with pytest.raises(GraphCaptureError, match="cannot read the generator states"):
        Snapshot.capture()


def test_snapshot_restore_inside_a_capture_refuses_before_changing_anything(device, untouched):
    snap = Snapshot.capture()
    random.random(), np.random.rand(), torch.rand(1), device.draw()  # move every stream on
    moved, states = World.now(), device.states()
    device.capturing = True
    with pytest.raises(GraphCaptureError, match="cannot put the generator states back"):
        snap.restore()
    assert World.now() == moved  # not even the sources restored before the device
    assert device.states() == states
    device.capturing = False
    snap.restore()
    assert World.now() == untouched


def test_loaded_snapshot_restore_inside_a_capture_refuses(device, untouched):
    snap = Snapshot.from_state_dict(Snapshot.capture().state_dict())
    device.draw()
    states = device.states()
    device.capturing = True
    with pytest.raises(GraphCaptureError):
        snap.restore()
    assert device.states() == states
    device.capturing = False
    snap.restore()


def test_direct_reseed_inside_a_capture_refuses():
    # Integrations (Hypothesis, pytest-randomly) seed the sources directly.
    dev = _GraphDevice()
    states = dev.states()
    dev.capturing = True
    with pytest.raises(GraphCaptureError):
        _source(dev).apply(Settings(0, False))
    assert dev.states() == states


def _live(dev: _GraphDevice, source: LazyAcceleratorSource) -> LiveState:
    state = source.capture()
    assert isinstance(state, LiveState)
    return state


def _initialized_inside(dev: _GraphDevice, source: LazyAcceleratorSource) -> LazyState:
    # Not initialized at capture; initialized inside the block.
    dev._initialized = False
    dev.default_generators = ()
    state = source.capture()
    assert isinstance(state, LazyState)
    source.apply(Settings(3, False))
    dev.lazy_init()
    return state


def _saved(dev: _GraphDevice, source: LazyAcceleratorSource) -> SavedState:
    return SavedState(tuple(PhiloxGenerator(9).get_state() for _ in range(2)), strict=False)


@pytest.mark.parametrize("kind", [_live, _initialized_inside, _saved])
def test_every_kind_of_restore_inside_a_capture_refuses_before_changing_anything(kind):
    dev = _GraphDevice()
    source = _source(dev)
    state = kind(dev, source)
    dev.draw()
    states, tracker, queued = dev.states(), dev.tracker(), list(dev._queued_calls)
    dev.capturing = True
    with pytest.raises(GraphCaptureError):
        source.restore(state)
    assert (dev.states(), dev.tracker(), dev._queued_calls) == (states, tracker, queued)
    dev.capturing = False
    source.restore(state)  # once the capture has ended


# --- around a capture: the supported pattern --------------------------------------------------


def test_block_outside_any_capture_seeds_and_restores(device, untouched):
    states = device.states()
    with deterministic(seed=5):
        assert device.draw() == _seeded(5)
    assert device.states() == states


def test_block_entered_before_a_capture_and_left_after_it_works(device, untouched):
    # The guarded generators raise if touched during the capture: the block
    # neither reads nor sets them between its entry and its exit.
    states = device.states()
    with deterministic(seed=0):
        device.capturing = True  # torch.cuda.graph(g).__enter__
        random.random()  # the captured body: no generator is touched
        device.capturing = False  # __exit__
        replay = device.draw()  # g.replay(): reads the seed and offset now
    assert replay == _seeded(0)
    assert device.states() == states
    with deterministic(seed=0):  # replayed in a second block: the same numbers
        assert device.draw() == replay
    assert device.states() == states


def test_block_left_during_a_capture_restores_the_rest_and_names_the_device(device, untouched):
    # Entered before ``capture_begin()``, left before ``capture_end()``: the
    # device's generators cannot be put back; everything else is, the block
    # is left and the lock released.
    states = device.states()
    with pytest.raises(RestoreError) as info, deterministic(seed=0):
        random.random(), np.random.rand(), torch.rand(1)
        device.capturing = True
    assert list(info.value.failures) == ["torch.cuda"]
    assert isinstance(info.value.failures["torch.cuda"], GraphCaptureError)
    assert World.now() == untouched
    assert _lock_released()
    device.capturing = False
    assert device.states() != states
    assert device.draw() == _seeded(0)  # the device kept the block's state, as documented


# --- what the check costs where it cannot matter ----------------------------------------------


def test_an_uninitialized_device_is_never_asked():
    dev = _GraphDevice(initialized=False)
    dev.capturing = True  # would refuse, if asked
    source = _source(dev)
    state = source.capture()
    source.apply(Settings(0, False))
    source.restore(state)
    refuse_inside_graph_capture((source,))
    assert dev.asked == 0


def test_a_cpu_build_never_asks_torch(monkeypatch, untouched):
    # torch.cuda's query is a stub that raises on a CPU build: it must never run.
    def never() -> bool:
        raise AssertionError("is_current_stream_capturing asked on a build without CUDA")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", never)
    cuda = next(s for s in _sources.SOURCES if s.name == "torch.cuda")
    assert isinstance(cuda, LazyAcceleratorSource)
    if cuda.can_initialize:
        pytest.skip("this torch build has CUDA")
    with deterministic(seed=0):
        torch.manual_seed(3)  # queues lazy CUDA seeds: the device source restores them
    snap = Snapshot.capture()
    snap.restore()
    refuse_inside_graph_capture((cuda,))
    assert not torch.cuda.is_initialized()


# --- real CUDA graphs (each scenario in a fresh interpreter) ----------------------------------

_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_GPU_PRELUDE = """
    import random
    import torch
    from deterministic_ctx import RestoreError, Snapshot, deterministic
    from deterministic_ctx.base.lock import LOCK
    from deterministic_ctx.core.engine import inside_block
    from deterministic_ctx.sources.accelerators import GraphCaptureError

    torch.cuda.init()
    torch.cuda.manual_seed(1234)  # the caller's own CUDA stream
    x = torch.ones(4096, device="cuda")
    drop = torch.nn.Dropout(p=0.5)

    def body():
        return torch.rand(1024, device="cuda"), drop(x), torch.randn(64, device="cuda")

    # Warm up on a side stream before capturing, as torch's CUDA graph docs ask.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    def same(a, b):
        return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))

    def digest(tensors):
        return [float(t.double().sum().item()) for t in tensors]
"""


def _run_gpu(code: str) -> list[str]:
    proc = run_python([], code=textwrap.dedent(_GPU_PRELUDE) + textwrap.dedent(code))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().splitlines()


_CAPTURE_IN_A_BLOCK = """
    before = torch.cuda.get_rng_state()
    g = torch.cuda.CUDAGraph()
    with deterministic(seed=0):  # entered before the capture: the supported pattern
        with torch.cuda.graph(g):
            static = body()
        g.replay()
        first = [t.clone() for t in static]
        g.replay()
        second = [t.clone() for t in static]
    torch.cuda.synchronize()
    after = torch.cuda.get_rng_state()
    with deterministic(seed=0):
        g.replay()
        again = [t.clone() for t in static]
    torch.cuda.synchronize()
"""


@pytest.mark.gpu
@_NEEDS_CUDA
def test_gpu_graph_captured_in_a_block_replays_reproducibly_and_restores_the_caller():
    code = (
        _CAPTURE_IN_A_BLOCK
        + """
    print(torch.equal(before, after))  # the caller's CUDA generator state is back
    print(same(first, again))  # replays in blocks of the same seed agree
    print(not same(first, second))  # successive replays draw fresh numbers
    print(torch.equal(torch.cuda.get_rng_state(), before), LOCK.depth == 0)
    print(digest(first))
    """
    )
    one, two = _run_gpu(code), _run_gpu(code)
    assert one[:4] == ["True", "True", "True", "True True"], one
    assert one[4] == two[4]  # run to run


@pytest.mark.gpu
@_NEEDS_CUDA
def test_gpu_graph_replay_in_a_block_gives_the_eager_numbers():
    # A graph reads its generator's seed and offset at replay: replayed first
    # thing in a block, it draws what the eager body draws first thing in one.
    out = _run_gpu(
        _CAPTURE_IN_A_BLOCK
        + """
    with deterministic(seed=0):
        eager = [t.clone() for t in body()]
    print(same(first, eager))
    """
    )
    assert out == ["True"]


@pytest.mark.gpu
@_NEEDS_CUDA
def test_gpu_block_entered_inside_a_capture_raises_and_the_capture_ends_cleanly():
    out = _run_gpu("""
    py_before, rng_before = random.getstate(), torch.cuda.get_rng_state()
    zeros = torch.zeros(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    errors = []
    with torch.cuda.graph(g):
        y = zeros + 1
        try:
            with deterministic(seed=0):
                errors.append("the body ran")
        except GraphCaptureError as exc:
            errors.append(str(exc))
        z = y * 2
    g.replay()
    torch.cuda.synchronize()
    print(z.tolist() == [2.0] * 16)  # the capture ended cleanly and replays
    print(len(errors) == 1 and "g.replay()" in errors[0], errors)
    print(random.getstate() == py_before, torch.equal(torch.cuda.get_rng_state(), rng_before))
    print(LOCK.depth == 0 and not inside_block())
    with deterministic(seed=0):  # blocks work again after the capture
        torch.rand(8, device="cuda")
    print(torch.equal(torch.cuda.get_rng_state(), rng_before))
    """)
    assert out[0] == "True", out
    assert out[1].startswith("True"), out
    assert out[2:] == ["True True", "True", "True"], out


@pytest.mark.gpu
@_NEEDS_CUDA
def test_gpu_snapshot_inside_a_capture_raises_and_changes_nothing():
    out = _run_gpu("""
    snap = Snapshot.capture()  # before the capture
    random.random()
    moved = random.getstate()
    zeros = torch.zeros(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    refused = []
    with torch.cuda.graph(g):
        y = zeros + 1
        for attempt in (Snapshot.capture, snap.restore):
            try:
                attempt()
            except GraphCaptureError:
                refused.append(attempt.__name__)
    g.replay()
    torch.cuda.synchronize()
    print(refused)
    print(random.getstate() == moved)  # the refused restore changed nothing
    snap.restore()  # after the capture: fine
    print(y.tolist() == [1.0] * 16)
    """)
    assert out == ["['capture', 'restore']", "True", "True"], out


@pytest.mark.gpu
@_NEEDS_CUDA
def test_gpu_block_left_during_a_capture_raises_restore_error_and_is_left():
    out = _run_gpu("""
    py_before, rng_before = random.getstate(), torch.cuda.get_rng_state()
    zeros = torch.zeros(16, device="cuda")
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()  # capture_begin() needs a side stream
    failure = None
    with torch.cuda.stream(stream):
        try:
            with deterministic(seed=0):
                random.random()
                g.capture_begin()
                y = zeros + 1
        except RestoreError as exc:
            failure = exc.failures.get("torch.cuda")
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    torch.cuda.synchronize()
    print(isinstance(failure, GraphCaptureError), random.getstate() == py_before)
    print(LOCK.depth == 0 and not inside_block())
    # As documented, the device kept the block's state.
    seeded = torch.Generator(device="cuda").manual_seed(0).get_state()
    print(torch.equal(torch.cuda.get_rng_state(), seeded))
    torch.cuda.set_rng_state(rng_before)
    print(y.tolist() == [1.0] * 16)
    """)
    assert out == ["True True", "True", "True", "True"], out
