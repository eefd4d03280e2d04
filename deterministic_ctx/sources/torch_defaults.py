"""torch's process defaults that decide what a draw or a result is.

Captured on entry and restored on exit, never applied: a block does not choose
them, so the caller's defaults are in force inside it.

* ``torch.set_default_dtype``: the same generator state gives other numbers
  for ``torch.rand`` in float32 and float64.
* ``torch.set_default_tensor_type`` (deprecated): its dtype is the default
  dtype; its device (``torch.cuda.HalfTensor``) sends factories to CUDA and
  their draws to the CUDA generator.  Read with ``_torch.flags.get_default_device``.
* ``torch.set_default_device``: a ``DeviceContext`` torch-function mode that
  torch keeps in the slot ``_torch.internals.device_context_slot`` reads (a
  ``threading.local`` in current torch, so it is the *calling thread's*
  default; a module global in torch 2.1) and pushes at the bottom of the
  mode stack.  The captured state is that object itself: restoring exits the
  body's context and re-enters the caller's, exactly as ``set_default_device``
  swaps them, so the very object (and the ``CURRENT_DEVICE`` that dynamo
  guards on) comes back.  "Never set" (no attribute) and ``None`` are told apart.
* ``torch.set_num_threads``: intra-op parallelism splits CPU reductions, so
  the thread count changes float results.
* ``torch.set_flush_denormal``: the calling thread's DAZ/FTZ bits (MXCSR on
  x86, FPCR.FZ on ARM), which torch sets both or neither and cannot read.
  Python's own float arithmetic runs on the same unit under the same
  register, so three multiplications read them: a denormal *input* times
  2**1000 is zero only under DAZ; a normal input times 1/3, rounded to a
  denormal and scaled back up by 2**100, is zero under FTZ (or DAZ).  FTZ
  without DAZ (set by other code) is restored only if it was not changed.

A block is a hot path: ``capture`` is four C calls (three on a build
without CUDA) and three float products into a plain tuple, about 0.3-0.4 µs,
and ``restore`` makes the same reads, comparing as it goes, and writes only
what differs.  A block deliberately leaves alone what does not
decide draws or results, or cannot be set back (``docs/explanation/captures.md``).
"""

from __future__ import annotations

import math
import struct
import threading
from typing import Any

import torch

from .._torch.flags import HAS_CUDA, get_default_device, set_default_dtype, set_default_tensor_type
from .._torch.internals import (
    device_context,
    device_context_slot,
    function_mode_stack,
    is_device_context,
    remove_function_mode,
    set_device_context_slot,
)
from ..base import plain as _plain
from ..base.settings import Settings
from ._base import SettingSource

__all__ = ["DefaultsState", "TorchDefaultsSource"]

# Module-level names, looked up per call, so that tests can stand in for torch.
_get_dtype = torch.get_default_dtype
_set_dtype = set_default_dtype
_get_tensor_type = get_default_device
_set_tensor_type = set_default_tensor_type
_get_threads = torch.get_num_threads
_set_threads = torch.set_num_threads
_set_flush = torch.set_flush_denormal
#: Only a CUDA build has tensor types of a device other than the CPU
#: (``torch.cuda.FloatTensor``); elsewhere the default tensor type's device is
#: always "cpu", and reading it (0.1-0.2 µs) is skipped.
_TENSOR_TYPE_DEVICES_VARY: bool = HAS_CUDA
#: The calling thread's torch-function modes, bottom first (only on the slow path).
_mode_stack = function_mode_stack


def _float(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


# The denormal probes.  Every value they give, and every value compared, is
# normal or zero: under DAZ a denormal *operand* of any comparison counts as
# zero, so a probe that left a denormal behind would be misread.  The
# operands are built from bit patterns or exact powers of two, not from
# arithmetic the probed register could distort.
_SMALLEST_DENORMAL = _float(1)  # 2**-1074
_DAZ_FACTOR = 2.0**1000
_SMALLEST_NORMAL = _float(1 << 52)  # 2**-1022
_FTZ_FACTOR = 1 / 3  # makes an inexact denormal result...
_FTZ_RESCALE = 2.0**100  # ...and scales it back to a normal number
#: ``_SMALLEST_DENORMAL * _DAZ_FACTOR`` while denormals are kept: 2**-74 (0.0 under DAZ).
KEPT_DAZ_PROBE = math.ldexp(1.0, -74)
#: ``_SMALLEST_NORMAL * _FTZ_FACTOR * _FTZ_RESCALE`` while denormals are kept:
#: the denormal 0x5555555555555 * 2**-1074, times 2**100 (0.0 under FTZ or DAZ).
KEPT_FTZ_PROBE = math.ldexp(float(0x5555555555555), -974)

#: What ``torch.set_default_dtype`` accepts (it refuses complex, integer and
#: float8 types), by the name a checkpoint stores, with the legacy tensor type
#: of each (``torch.set_default_tensor_type``).
_DTYPE_TABLE = (
    ("float16", torch.float16, "HalfTensor"),
    ("bfloat16", torch.bfloat16, "BFloat16Tensor"),
    ("float32", torch.float32, "FloatTensor"),
    ("float64", torch.float64, "DoubleTensor"),
)
_DTYPES = {name: dtype for name, dtype, _ in _DTYPE_TABLE}
_DTYPE_NAMES = {dtype: name for name, dtype, _ in _DTYPE_TABLE}
_TENSOR_TYPES = {dtype: tensor_type for _, dtype, tensor_type in _DTYPE_TABLE}
#: The devices a default tensor type can have: torch only has CPU and CUDA ones.
_TENSOR_TYPE_DEVICES = ("cpu", "cuda")
#: A loaded thread count above this is refused: far above any machine's cores,
#: far below what would exhaust the process when the next parallel op starts them.
MAX_THREADS = 4096

_KEY = "device_context"
_ABSENT: Any = type("_Absent", (), {"__repr__": lambda self: "<never set>"})()

#: A captured state is a plain tuple (a NamedTuple costs ~0.1 µs more to build):
#: ``(dtype, tensor type device, device context, threads, DAZ probe, FTZ probe)``.
#: The device context is the object ``set_default_device`` installed, ``None``
#: (set to ``None``) or ``_ABSENT`` (never set in this thread); the probes are
#: 0.0 when denormals are flushed (see above), normal numbers otherwise.
DefaultsState = tuple[torch.dtype, str, Any, int, float, float]
DTYPE, TENSOR_TYPE, DEVICE_CONTEXT, THREADS, DAZ_PROBE, FTZ_PROBE = range(6)


class TorchDefaultsSource(SettingSource):
    """Default dtype, tensor type and device, thread count and denormal mode."""

    name = "torch.defaults"

    def __init__(self, holder: Any = torch) -> None:
        # ``holder`` is where torch keeps the default device context: the torch
        # module (tests pass a stand-in for older torch versions).
        slot = device_context_slot(holder)
        self._local: threading.local | None = slot if isinstance(slot, threading.local) else None
        self._holder = holder

    def capture(self) -> DefaultsState:
        local = self._local
        return (
            _get_dtype(),
            _get_tensor_type() if _TENSOR_TYPE_DEVICES_VARY else "cpu",
            # ``__dict__.get``: ``getattr`` with a default costs ~0.7 µs when absent.
            local.__dict__.get(_KEY, _ABSENT)
            if local is not None
            else device_context_slot(self._holder),
            _get_threads(),
            _SMALLEST_DENORMAL * _DAZ_FACTOR,
            _SMALLEST_NORMAL * _FTZ_FACTOR * _FTZ_RESCALE,
        )

    #: :meth:`apply` does nothing: ``apply_all`` may skip it.
    applies_nothing = True

    def apply(self, settings: Settings) -> None:
        """Nothing: a block keeps the caller's defaults."""

    def restore(self, state: DefaultsState) -> None:
        now = self.capture()
        if now == state:  # the usual case: nothing changed (the context compares by identity)
            return
        dtype, tensor_type, context, threads, daz, ftz = state
        # Every part is idempotent (a restore interrupted half-way is simply run
        # again), and the device context, the only part that can fail on a mode
        # stack the body left in disorder, comes last.
        if now[TENSOR_TYPE] != tensor_type:
            _set_tensor_type(_tensor_type(tensor_type, dtype))
        elif now[DTYPE] != dtype:
            _set_dtype(dtype)
        if now[THREADS] != threads:
            _set_threads(threads)
        if (now[DAZ_PROBE] != daz or now[FTZ_PROBE] != ftz) and not _set_flush(
            _flush_mode(daz, ftz)
        ):
            raise ValueError("torch.set_flush_denormal is not supported on this CPU")
        if now[DEVICE_CONTEXT] is not context:
            self._restore_context(now[DEVICE_CONTEXT], context)

    def _restore_context(self, current: Any, saved: Any) -> None:
        # What ``torch.set_default_device`` does, with the saved object instead
        # of a new one.  Membership checks make a second run after an
        # interruption neither exit nor enter a context twice.
        if _is_context(current):
            stack = _mode_stack()
            if any(mode is current for mode in stack):
                if any(is_device_context(mode) and mode is not current for mode in stack):
                    remove_function_mode(current)
                else:
                    current.__exit__(None, None, None)
        if _is_context(saved) and not any(mode is saved for mode in _mode_stack()):
            saved.__enter__()
        local = self._local
        if local is None:
            set_device_context_slot(self._holder, None if saved is _ABSENT else saved)
        elif saved is _ABSENT:
            local.__dict__.pop(_KEY, None)
        else:
            setattr(local, _KEY, saved)

    def export_state(self, state: DefaultsState) -> dict[str, Any]:
        """The state as plain data: ``{"dtype", "tensor_type", "threads",
        "flush_denormal"}`` and ``"device"`` when a default device is set.

        Raises ``ValueError`` for a state a loaded snapshot could not restore
        through torch: denormal results flushed (FTZ) but not inputs (DAZ),
        as set by something other than ``torch.set_flush_denormal``.
        """
        dtype, tensor_type, context, threads, daz, ftz = state
        flush = _flush_mode(daz, ftz)
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            raise ValueError(f"the default dtype {dtype} cannot be saved")
        out: dict[str, Any] = {
            "dtype": name,
            "tensor_type": tensor_type,
            "threads": threads,
            "flush_denormal": flush,
        }
        if _is_context(context):
            out["device"] = str(context.device)
        return out

    def import_state(self, data: object, path: str) -> DefaultsState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        ``device`` may be absent (no default device: the loaded snapshot
        leaves none set, as in a thread that never set one).  Nothing here
        initializes a device: a CUDA default device is a parsed
        ``torch.device``, used only by the next factory call, as after
        ``torch.set_default_device("cuda")``.
        """
        d = _plain.fields(
            data, path, ["dtype", "tensor_type", "threads", "flush_denormal"], ["device"]
        )
        dtype = _DTYPES[_plain.text(d["dtype"], f"{path}.dtype", choices=_DTYPES)]
        tensor_type = _plain.text(
            d["tensor_type"], f"{path}.tensor_type", choices=_TENSOR_TYPE_DEVICES
        )
        if tensor_type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"{path}.tensor_type: the snapshot's default tensor type is a CUDA one "
                f"(torch.set_default_tensor_type), and CUDA is not available here"
            )
        threads = _plain.integer(d["threads"], f"{path}.threads", 1, MAX_THREADS)
        flush = _plain.flag(d["flush_denormal"], f"{path}.flush_denormal")
        # Whether set_flush_denormal works here, found without changing the mode:
        # something flushes already (torch, or other code: restore tells), or it
        # is off and set to off once more.
        if flush and _SMALLEST_NORMAL * _FTZ_FACTOR * _FTZ_RESCALE != 0.0 and not _set_flush(False):
            raise ValueError(
                f"{path}.flush_denormal: the snapshot flushes denormals, and "
                f"torch.set_flush_denormal cannot on this CPU"
            )
        context: Any = _ABSENT
        device = d.get("device")
        if device is not None:
            text = _plain.text(device, f"{path}.device", max_len=64)
            try:
                parsed = torch.device(text)
            except Exception as exc:  # RuntimeError for every malformed string
                raise ValueError(f"{path}.device: torch cannot parse {text!r} ({exc})") from exc
            context = device_context(parsed)  # entered only when restored
        if flush:
            return (dtype, tensor_type, context, threads, 0.0, 0.0)
        return (dtype, tensor_type, context, threads, KEPT_DAZ_PROBE, KEPT_FTZ_PROBE)


def _is_context(value: Any) -> bool:
    return value is not None and value is not _ABSENT


def _tensor_type(device: str, dtype: torch.dtype) -> Any:
    """The legacy tensor type class for a default tensor type's device and dtype."""
    if device not in _TENSOR_TYPE_DEVICES or dtype not in _TENSOR_TYPES:
        raise ValueError(f"no legacy tensor type for device {device!r} and dtype {dtype}")
    module = torch if device == "cpu" else getattr(torch, device)
    return getattr(module, _TENSOR_TYPES[dtype])


def _flush_mode(daz_probe: float, ftz_probe: float) -> bool:
    """Whether denormals are flushed, as ``torch.set_flush_denormal`` sets it
    (both DAZ and FTZ, or neither); ``ValueError`` for FTZ alone, which some
    other code set and torch cannot set back."""
    if daz_probe == 0.0:
        return True  # DAZ (FTZ cannot be read under it; torch sets both)
    if ftz_probe == 0.0:
        raise ValueError(
            "the CPU flushes denormal results (FTZ) but not denormal inputs (DAZ), as set by "
            "something other than torch.set_flush_denormal, which can only set both or neither"
        )
    return False
