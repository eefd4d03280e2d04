"""Accelerator generators: CUDA, XPU and MTIA (lazily initialized), and MPS.

One source implementation serves them all (:class:`LazyAcceleratorSource`):
MPS is seen as a device module that is always initialized, with one generator
and nothing queued (:class:`_MPSModule`), so it takes the initialized path of
the others, load-time checks included.

CUDA, XPU and MTIA share torch's lazy-initialization design, and its traps:

* ``torch.cuda.get_rng_state()`` *initializes* CUDA (and breaks forked
  workers, Lightning #16262).  Before initialization the only RNG state is
  what torch has *queued* for initialization: the latest ``manual_seed`` /
  ``manual_seed_all`` in ``_lazy_seed_tracker``, and ``set_rng_state`` calls
  appended to ``_queued_calls`` (a list that never drains on a machine
  without the device, so calling ``set_rng_state`` per block leaks).
* ``torch.manual_seed`` queues through that tracker with a formatted stack
  trace (~150 µs).  We queue our own seed callback with a one-line note.

So a captured state is either *live* (per-device generator states, read only
once the device is initialized) or *lazy* (what is queued).  If the device is
first initialized inside a block, it was seeded from the block's seed, and on
exit every generator is set to what initialization would have produced from
the captured queue: a fresh generator seeded from the OS's randomness, as
torch's own initialization seeds it, then the captured queued calls (a
``torch.manual_seed`` queued before the block is replayed, so its stream is
the one the program would have drawn).

**Graph capture (CUDA graphs, XPU graphs).**  While the calling thread's
current stream is capturing a graph, capturing, seeding and restoring an
initialized device raise :class:`GraphCaptureError` before anything of the
device is read or changed (``Snapshot.restore()`` checks first,
:func:`refuse_inside_graph_capture`, so it changes nothing at all); why not
swap states with the graph-safe API instead, and the supported pattern, are
in ``docs/how-to/compile.md`` ("CUDA graphs").  A graph-safe path could not
be tested on a machine without a GPU: a clear error is honest where a wrong
stream would be silent.  The check is made only on the initialized path,
with one ``is_current_stream_capturing()`` call (a stream query; it never
initializes the device and is legal during a capture).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from operator import methodcaller
from types import ModuleType
from typing import Any, NamedTuple

import torch

from .. import _torch
from .._torch.flags import HAS_MPS
from .._torch.internals import (
    bad_fork_check,
    is_compiled_check,
    lazy_seed_queue,
)
from ..base import plain as _plain
from ..base.errors import DeviceMismatchError, GraphCaptureError
from ..base.fast_paths import FastPath
from ..base.settings import Settings
from .rngs.uncollected import GET_STATE_COLLECTS, get_state

__all__ = [
    "PHILOX_DEVICES",
    "GraphCaptureError",
    "LazyAcceleratorSource",
    "SavedState",
    "accelerator_sources",
    "check_foreign_devices",
    "check_philox_state",
    "device_mismatch",
    "device_states_from_plain",
    "refuse_inside_graph_capture",
]

_NOTE = ["  (seed queued by deterministic_ctx on entry to a deterministic block)\n"]
_RESTORE_NOTE = ["  (generator states queued by deterministic_ctx restoring a loaded snapshot)\n"]
#: More devices than any machine has; bounds what a crafted checkpoint can declare.
_MAX_DEVICES = 4096
#: Device types whose default generators are torch's Philox generators
#: (``CUDAGeneratorImpl``, ROCm's as well, and ``XPUGeneratorImpl``): their states
#: have rules of their own, which :func:`check_philox_state` checks at load.
PHILOX_DEVICES = frozenset({"cuda", "xpu"})
#: A Philox generator state: the seed, then the offset, in native byte order (torch
#: ``memcpy``s them).  CUDA writes the offset as an int64 and XPU as a uint64: the
#: same bytes, read here unsigned as torch's ``set_state`` uses them.
_PHILOX_STATE = struct.Struct("=QQ")


class LiveState(NamedTuple):
    states: tuple[torch.Tensor, ...]


class LazyState(NamedTuple):
    seed_all: Any
    seed_one: Any
    call_order: tuple[Any, ...]
    queued: tuple[Any, ...]


class SavedState(NamedTuple):
    """Generator states read from a checkpoint, one per device, already matched
    to this machine's device count; empty if the device was not initialized
    where the snapshot was taken.  ``strict`` is the loader's ``strict_devices``."""

    states: tuple[torch.Tensor, ...]
    strict: bool


def _is_rng_call(entry: Any) -> bool:
    # ``set_rng_state(s)`` queues ``set_rng_state.<locals>.cb``; other queued
    # calls (capability checks, ...) are not RNG state and are left alone.
    fn = entry[0] if isinstance(entry, tuple) and entry else entry
    name = getattr(fn, "__qualname__", "")
    return "rng_state" in name or "seed" in name


class LazyAcceleratorSource:
    """The default generators of an accelerator device type: a lazily initialized
    one (CUDA, XPU, MTIA), or MPS through :class:`_MPSModule`."""

    def __init__(
        self,
        module: ModuleType | Any,
        device_type: str,
        fresh_state: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.name = f"torch.{device_type}"
        self._m = module
        #: ``"cuda"``, ``"xpu"``, ``"mtia"`` or ``"mps"``: the key of this device in a checkpoint.
        self.device_type = device_type
        self._fresh_state = fresh_state or self._torch_fresh_state
        compiled = is_compiled_check(module)
        #: Whether this build can ever initialize the device: without it (a CPU
        #: build's ``torch.cuda``) the device is never initialized, and its state
        #: is only what torch has queued.  A seed queued for it would never be
        #: used: entering a block skips it.  Its tracker is still captured and
        #: restored, because ``torch.manual_seed`` inside the block queues there.
        self.can_initialize = bool(compiled()) if compiled is not None else True
        #: Whether :meth:`apply` always returns at once (this build can never
        #: initialize the device): ``apply_all`` may skip it.
        self.applies_nothing = not self.can_initialize
        self.fast_paths: tuple[FastPath, ...] = ()
        #: Whether this is a child forked after the device initialized, which
        #: cannot use it (like ``torch.manual_seed``, nothing is done then).
        self._bad_fork: Callable[[], bool] = bad_fork_check(module) or (lambda: False)
        # torch's seed tracker and queue of calls for initialization: objects made
        # once, when torch imports the device module, and only mutated since.
        self._tracker, self._queued = lazy_seed_queue(module)

    def _torch_fresh_state(self, index: int) -> torch.Tensor:
        # What initialization gives a default generator: torch seeds it from the
        # OS's randomness (``Generator.seed()``), so a fresh process's stream is
        # unpredictable, not the fixed ``default_rng_seed_val`` of a bare
        # ``torch.Generator(device)`` (seen on an H200: torch.cuda.initial_seed()
        # differs from process to process).
        generator = torch.Generator(device=torch.device(self.device_type, index))
        generator.seed()
        return generator.get_state()

    def _refuse_inside_capture(self, what: str = "put the generator states back") -> None:
        """Raise :class:`GraphCaptureError` if the calling thread's current stream
        of this device is capturing a graph now.

        Only asked on the initialized path (the caller checked): asking never
        initializes the device, but on a build without it torch's query is a
        stub that raises.  A module without graphs (MPS) is never capturing.
        """
        # Looked up per call, not bound at construction, so that tests can patch the module.
        query = getattr(self._m, "is_current_stream_capturing", None)
        if query is not None and query():
            graphs = f"{self.device_type.upper()} graph"
            raise GraphCaptureError(
                f"{self.name}: cannot {what} while a {graphs} is being captured on the current "
                f"stream. torch forbids reading or setting a generator's state during capture, "
                f"and a captured graph reads the seed and offset when it is replayed, not when "
                f"it is captured. Enter the deterministic block (or take the snapshot) before "
                f"the capture begins and replay inside a block instead, e.g. "
                f"`with deterministic(seed=0): g.replay()`, or seed before the capture. To "
                f"switch generators within one graph, register each with the graph before "
                f"capture (`g.register_generator_state(gen)`) and swap them with "
                f"`torch.Generator.graphsafe_set_state`."
            )

    def capture(self) -> LiveState | LazyState:
        m = self._m
        # A device this build cannot initialize is never asked (a Python call of torch's).
        if self.can_initialize and m.is_initialized():
            self._refuse_inside_capture("read the generator states")
            # One C-level loop, and no NamedTuple ``__new__`` frame: this runs
            # in every block once CUDA is in use.
            return tuple.__new__(LiveState, (tuple(map(_get_state, m.default_generators)),))
        t, queued = self._tracker, self._queued
        # LazyState(...) without the Python call of a NamedTuple's __new__ (0.1 µs).
        return tuple.__new__(
            LazyState,
            (t.manual_seed_all_cb, t.manual_seed_cb, tuple(t.call_order), tuple(queued)),
        )

    def reseeder(self) -> None:
        """``None``: ``apply`` runs (lazy seeds for a device not initialized yet)."""
        return

    def apply(self, settings: Settings) -> None:
        m = self._m
        if not self.can_initialize or self._bad_fork():
            return  # like torch.manual_seed: the device cannot be used in this process
        seed = settings.seed
        if m.is_initialized():
            # Blocks capture (and so check) just before; integrations that
            # reseed directly (Hypothesis, pytest-randomly) come here first.
            self._refuse_inside_capture("seed the generators")
            _seed(m.default_generators, seed)
            return

        def seed_all() -> None:  # runs at initialization, when the generators exist
            _seed(m.default_generators, seed)

        self._tracker.queue_seed_all(seed_all, _NOTE)

    def restore(self, state: LiveState | LazyState | SavedState) -> None:
        m, t = self._m, self._tracker
        if isinstance(state, LazyState):
            initialized = self.can_initialize and m.is_initialized()
            if initialized:
                # Initialized since ``state`` was captured (inside the block): refuse
                # before the tracker is touched too, so that a refusal changes nothing.
                self._refuse_inside_capture()
            # The usual case: the device was not in use then and is not now, and
            # the tracker is as it was (compared first: three devices, every block).
            if (
                t.manual_seed_all_cb is not state.seed_all
                or t.manual_seed_cb is not state.seed_one
                or len(t.call_order) != len(state.call_order)
                or tuple(t.call_order) != state.call_order
            ):
                t.manual_seed_all_cb, t.manual_seed_cb = state.seed_all, state.seed_one
                t.call_order = list(state.call_order)
            if initialized:
                if not self._bad_fork():
                    self._initialize_without_block(state)
            elif len(self._queued) != len(state.queued):
                # Drop the RNG calls queued since the capture; keep everything else.
                kept = set(map(id, state.queued))
                self._queued[:] = [c for c in self._queued if id(c) in kept or not _is_rng_call(c)]
            return
        if self._bad_fork():
            return  # a forked child cannot use the device at all
        if isinstance(state, SavedState) and not state.states:
            self._keep_unsaved(state.strict)  # not initialized where it was saved
        elif m.is_initialized():
            self._refuse_inside_capture()
            generators = m.default_generators
            if type(state) is LiveState and len(generators) != len(state.states):
                raise DeviceMismatchError(
                    f"{self.name}: {len(state.states)} device generator(s) captured, "
                    f"{len(generators)} present"
                )
            # A saved state's device count was matched at load: zip stops at the shorter.
            _set_states(generators, state.states)
        else:
            self._queue_states(state.states)

    def _initialize_without_block(self, state: LazyState) -> None:
        """First initialized inside the block: set every generator to what
        initialization would have produced without the block."""
        for index, gen in enumerate(self._m.default_generators):
            gen.set_state(self._fresh_state(index))
        replay = [c for c in state.queued if _is_rng_call(c)]
        replay += [c for c in state.call_order if c]
        for fn, _trace in replay:
            fn()

    def export_state(self, state: LiveState | LazyState | SavedState) -> dict[str, Any]:
        """The state as plain data: ``{"initialized": bool, "states": [uint8 tensor per device]}``.

        A device that was not initialized has no generator yet, only queued
        callbacks, which are code and are not saved (see :meth:`_keep_unsaved`).
        """
        states = () if isinstance(state, LazyState) else state.states
        return {"initialized": bool(states), "states": [s.clone() for s in states]}

    def import_state(self, data: object, path: str, *, strict: bool = False) -> SavedState | None:
        """Check saved data (``None``: the checkpoint has no entry for this device)
        and match it to the devices here; ``None`` if nothing is left to restore.

        N saved generators, M devices here, N != M: ``ValueError`` if ``strict``,
        else a warning and the first min(N, M) devices are restored.  Before
        the device is initialized, M is ``device_count()`` (as
        ``torch.cuda.is_available()`` does, this asks the driver, but does not
        initialize torch's CUDA state); it is only asked when N > 0.
        """
        states = (
            ()
            if data is None
            else device_states_from_plain(data, path, device_type=self.device_type)
        )
        if not states and self._tracker is not None:
            return SavedState(states, strict)  # not initialized there: see _keep_unsaved
        # MPS (no tracker) is always initialized: no states there is a device mismatch.
        m = self._m
        initialized = m.is_initialized()
        here = len(m.default_generators) if initialized else int(m.device_count())
        if len(states) != here:
            device_mismatch(path, self.name, len(states), here, strict=strict)
            states = states[:here]
            if not states:
                return None
        if initialized and self.device_type not in PHILOX_DEVICES:
            # No rule of torch's is known here for these states (MPS, MTIA) but
            # their size, which a live generator's shows.
            size = _get_state(m.default_generators[0]).numel()
            for i, state in enumerate(states):
                _plain.byte_tensor(state, f"{path}.states[{i}]", numel=size)
        return SavedState(states, strict)

    def _keep_unsaved(self, strict: bool) -> None:
        """Not initialized where it was saved: nothing drew from it there.  If it
        is not initialized here either, what torch has queued here (e.g. the
        script's own ``torch.manual_seed``) is kept."""
        if self._m.is_initialized():
            problem = (
                f"{self.name}: the snapshot was taken before the device was initialized, "
                f"so it has no generator state for the devices in use here"
            )
            if strict:
                raise DeviceMismatchError(f"{problem} (strict_devices=True)")
            _plain.warn(f"{problem}; they keep their current state")

    def _queue_states(self, states: tuple[torch.Tensor, ...]) -> None:
        """Not initialized: like ``torch.cuda.set_rng_state``, apply the states at
        initialization, and drop queued seeds, which the restore supersedes
        (torch runs them after the queued calls).  The callback's name marks
        it as an RNG call, so a block around this restore drops it on exit."""
        m = self._m

        def set_rng_states() -> None:
            _set_states(m.default_generators, states)

        tracker = self._tracker
        tracker.manual_seed_all_cb = tracker.manual_seed_cb = None
        tracker.call_order = []
        self._queued.append((set_rng_states, _RESTORE_NOTE))


def refuse_inside_graph_capture(sources: tuple[object, ...]) -> None:
    """Raise :class:`GraphCaptureError` if any accelerator device among
    ``sources`` is capturing a graph on the current stream.

    What ``Snapshot.restore()`` checks first, so that a refusal changes no
    source at all (the sources themselves refuse only their own device, after
    the sources restored before them).  No device is asked unless it is
    initialized, and the devices that can be are found once per ``sources``
    tuple: on a build without accelerators this is an identity check.
    """
    global _graph_devices
    seen, devices = _graph_devices
    if seen is not sources:
        devices = tuple(
            s for s in sources if isinstance(s, LazyAcceleratorSource) and s.can_initialize
        )
        _graph_devices = (sources, devices)
    for source in devices:
        if source._m.is_initialized():
            source._refuse_inside_capture()


#: The last ``sources`` tuple :func:`refuse_inside_graph_capture` was given,
#: and its devices that can be initialized (``SOURCES`` rarely changes).
_graph_devices: tuple[tuple[object, ...] | None, tuple[LazyAcceleratorSource, ...]] = (None, ())


#: ``gen.get_state()`` as a C-level call, for ``map`` over a device's
#: generators, where torch allows no collection inside it (see
#: :mod:`.rngs.uncollected`).
_get_state: Callable[[Any], torch.Tensor] = (
    get_state if GET_STATE_COLLECTS else methodcaller("get_state")
)


def _seed(generators: Sequence[Any], seed: int) -> None:
    for gen in generators:
        gen.manual_seed(seed)


def _set_states(generators: Sequence[Any], states: tuple[torch.Tensor, ...]) -> None:
    for gen, saved in zip(generators, states, strict=False):
        gen.set_state(saved)


class _MPSModule:
    """``torch.mps`` (or a stand-in with its ``get_rng_state``, ``set_rng_state``
    and ``manual_seed``) in the shape of a lazily initialized device module that
    is always initialized: one device, whose generator (this object) those
    public functions read, set and seed; no seed tracker, nothing queued, no
    graphs."""

    _lazy_seed_tracker = _queued_calls = None

    def __init__(self, mps: Any) -> None:
        self.default_generators = (self,)
        self.get_state = mps.get_rng_state
        self.set_state = mps.set_rng_state
        self.manual_seed = mps.manual_seed

    @staticmethod
    def is_initialized() -> bool:
        return True


def accelerator_sources() -> Sequence[LazyAcceleratorSource]:
    """The accelerator sources this torch build has.

    CUDA, XPU and MTIA are managed even on builds without them: ``torch.manual_seed``
    inside a block still queues lazy seeds for them, and those must not outlive
    the block.  A device module that lacks the lazy-seeding internals captured
    here (``torch.xpu`` before torch 2.4, ``torch.mtia`` without
    ``default_generators`` in torch 2.6: see ``_torch.LAZY_DEVICES``) is left
    out, and :func:`~deterministic_ctx.report` names it: no torch of those
    versions seeds its generators from ``torch.manual_seed`` either.
    """
    found: list[LazyAcceleratorSource] = []
    for device_type in ("cuda", "xpu", "mtia"):
        module = _torch.lazy_device(device_type)
        if module is not None:
            found.append(LazyAcceleratorSource(module, device_type))
    if HAS_MPS and torch.backends.mps.is_available():
        found.append(LazyAcceleratorSource(_MPSModule(torch.mps), "mps"))
    return found


def device_states_from_plain(
    data: object, path: str, *, device_type: str
) -> tuple[torch.Tensor, ...]:
    """The checked generator states of one device type, as saved by ``export_state``.

    States of a :data:`PHILOX_DEVICES` type are checked as torch's ``set_state``
    would check them (:func:`check_philox_state`), so that loading refuses what
    restoring would fail on after it had restored other sources.
    """
    d = _plain.fields(data, path, ["initialized", "states"])
    initialized = _plain.flag(d["initialized"], f"{path}.initialized")
    states = d["states"]
    if type(states) is not list or len(states) > _MAX_DEVICES or initialized != bool(states):
        raise ValueError(
            f"{path}.states: expected a list of at most {_MAX_DEVICES} generator states, "
            f"empty exactly when the device was not initialized"
        )
    checked = tuple(_plain.byte_tensor(s, f"{path}.states[{i}]") for i, s in enumerate(states))
    if device_type in PHILOX_DEVICES:
        for i, state in enumerate(checked):
            check_philox_state(state, f"{path}.states[{i}]", device_type)
    return checked


def check_philox_state(state: torch.Tensor, path: str, device_type: str) -> None:
    """Raise ``ValueError`` naming ``path`` if torch's ``set_state`` would refuse
    ``state``, a CPU uint8 state of a generator of ``device_type`` (one of
    :data:`PHILOX_DEVICES`).

    torch's rules (``CUDAGeneratorImpl::set_state``, ``XPUGeneratorImpl::set_state``):
    the state is 16 bytes, a seed then a Philox offset; any 64-bit seed is taken; the
    offset must be a multiple of 4, and a state whose offset is not is refused only
    *after* the seed was set, so that restoring it would change the generator, fail,
    and leave every source restored before it restored.  Every offset torch writes is
    a multiple of 4 (it rounds each increment up), so a real snapshot always passes.

    torch also accepts 8 bytes (a seed alone, offset 0), but has written 16 since
    2.1, the oldest torch supported: a state of any other size is not one a snapshot
    holds.  No offset range is checked beyond that: torch takes any 64-bit offset,
    and its ``get_state`` writes one past ``2**63 - 1`` (set with ``set_offset``) as
    a negative int64, which must load and restore as it does in torch.

    Example:
        >>> state = torch.zeros(16, dtype=torch.uint8)  # seed 0, offset 0
        >>> check_philox_state(state, "devices.cuda.states[0]", "cuda")
        >>> state[8] = 6  # the offset's low byte
        >>> check_philox_state(state, "devices.cuda.states[0]", "cuda")
        Traceback (most recent call last):
        ...
        ValueError: devices.cuda.states[0]: the cuda generator's Philox offset is 6, not a ...
    """
    size = _PHILOX_STATE.size
    if state.numel() != size:
        raise ValueError(
            f"{path}: expected a {device_type} generator state of {size} bytes "
            f"(a 64-bit seed, then a 64-bit Philox offset), got {state.numel()}"
        )
    # The seed needs no check: 8 bytes hold only what torch's seed (a uint64) takes.
    _seed, offset = _PHILOX_STATE.unpack(state.numpy().tobytes())
    if offset % 4:
        raise ValueError(
            f"{path}: the {device_type} generator's Philox offset is {offset}, not a "
            f"multiple of 4, which torch refuses to restore (every offset torch writes is one)"
        )


def check_foreign_devices(devices: dict[str, object], known: set[str], *, strict: bool) -> None:
    """Check every saved device entry, including those of device types this
    torch build lacks (whose generators cannot be restored here: a mismatch)."""
    for name, entry in devices.items():
        path = f"devices.{_plain.text(name, 'devices (a key)', max_len=64)}"
        saved_states = device_states_from_plain(entry, path, device_type=name)
        if name not in known and saved_states:
            device_mismatch(path, f"torch.{name}", len(saved_states), 0, strict=strict)


def device_mismatch(path: str, name: str, saved: int, here: int, *, strict: bool) -> None:
    """Saved generators and devices here differ: raise if ``strict``, else warn."""
    problem = (
        f"{path}: the snapshot holds {saved} {name} generator state(s), "
        f"this process has {here} such device(s)"
    )
    if strict:
        raise ValueError(f"{problem} (strict_devices=True)")
    _plain.warn(f"{problem}: restoring the first {min(saved, here)}")
