"""torch determinism and precision flags, restored exactly.

Applied inside a block (they choose *which* algorithm runs):

* ``torch.backends.cudnn.deterministic = True`` and ``.benchmark = False``;
* ``torch.use_deterministic_algorithms(True, warn_only=...)``: both booleans;
* ``torch.utils.deterministic.fill_uninitialized_memory = True``;
* ``torch.backends.mkldnn.deterministic = True``;
* ``torch._inductor.config.deterministic = True``, *only if inductor is
  already imported*: ``use_deterministic_algorithms`` imports it (~1.2 s) to
  set this; we call the C setter directly and never import it ourselves.

**Inductor.**  Its config tells a value from a default (``_is_default``), and
its compile-cache keys see the difference, so the state is the entry's *user
override* (torch's sentinel when nobody set it), read and written the way
torch's own ``_make_closure_patcher`` does, with the hash and ``get_dict``
caches marked dirty.  That is also cheaper than ``config.deterministic``
(~1.2 µs per read, 0.8 µs per write).  Overrides are per thread (a
``ContextVar`` in torch), so a block restores the calling thread's.  If
inductor is first imported inside a block, the override is cleared on exit:
as if the block had never touched it, the flag is at its default, which
``TORCHINDUCTOR_DETERMINISTIC`` chose at import.

**Precision** is captured and restored but never changed (it trades
precision, and TF32 results are themselves deterministic).  In torch ≥ 2.9
(``aten/src/ATen/Context.cpp``) it is this state:

* nine ``fp32_precision`` entries: ``generic.all``; ``all``, ``matmul``,
  ``conv``, ``rnn`` of ``cuda`` and of ``mkldnn``.  Each holds its *own*
  value, ``"none"`` meaning "inherit", and the getters report the resolved
  one: own value, else the backend's ``all``, else ``generic.all`` (``bf16``
  reads ``"none"`` for cuda).  cuDNN conv and rnn start in a fourth state
  that no setter accepts (torch 2.13's ``DEFAULT``): they read ``"tf32"``
  while no parent is set and follow a parent once one is.  Here it is
  written ``"default"``.  The setters write one entry each, nothing else.
* the legacy ``float32_matmul_precision`` (highest/high/medium), a separate
  field.  ``set_float32_matmul_precision`` writes it and both matmul entries
  (ieee/ieee, tf32/tf32, tf32/bf16); ``cuda.matmul.allow_tf32`` writes it
  (high/highest) and ``cuda.matmul`` (tf32/ieee).  Its getter raises ("mix
  of the legacy and new APIs") when the resolved matmul entries contradict
  it; the field is then inferred from which getters raise.
* the legacy cuDNN ``allow_tf32`` flag, a separate field, written with conv
  and rnn (tf32 or none) by ``cudnn.allow_tf32``.  Its getter answers only
  while conv and rnn both resolve to tf32 or both not, and raises when the
  flag disagrees with them: when they disagree with each other it is read
  by making them agree for one call.
* the oneDNN ``allow_tf32`` flag (XPU builds; elsewhere torch ignores it).

Because the getters report resolved values, an entry that inherits ``tf32``
and one set to ``tf32`` read alike, and differ once the parent changes.
Where any parent is set, a capture therefore finds each entry's own value by
unsetting the parents for a moment and putting them back (a few µs; captures
and restores in other threads wait for it, but torch ops running in other
threads at that moment see the unset parents); where none is set, the
resolved values *are* the own values and nothing is written.  A restore
writes the legacy fields first (their setters overwrite entries), then each
entry whose own value differs.  cuDNN's initial state cannot be written back:
if the body overwrote it, the restore writes the value that behaves the same
under the restored parents (``"tf32"`` with no parent set, else ``"none"``),
which differs only once the parents change between "none" and set.

``torch.backends.cudnn.flags()`` is not used: it defaults to ``enabled=False``
and would turn cuDNN off.
"""

from __future__ import annotations

import operator
import os
import re
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

from .. import _torch
from .._torch.flags import (
    get_cublas_allow_tf32,
    get_cudnn_allow_tf32,
    get_cudnn_benchmark,
    get_cudnn_deterministic,
    get_deterministic_algorithms,
    get_deterministic_algorithms_warn_only,
    get_float32_matmul_precision,
    set_cudnn_allow_tf32,
    set_cudnn_benchmark,
    set_cudnn_deterministic,
    set_deterministic_algorithms,
    set_float32_matmul_precision,
)
from .._torch.internals import INDUCTOR_CONFIG
from ..base.settings import Settings
from . import _plain
from ._config import AT_DEFAULT, ConfigEntry

__all__ = ["PRECISION_OPS", "UNSUPPORTED_FLAGS", "FlagState", "TorchFlagsSource"]

_get_precision: Any
_set_precision: Any
_get_precision, _set_precision = _torch.FP32_PRECISION.value or (None, None)
#: The getter for the hot paths, which run it only where the API exists (``_EXACT``).
_get_any: Any = _get_precision


def _supported(pair: tuple[str, str]) -> bool:
    if _get_precision is None:
        return False
    try:
        _get_precision(*pair)
    except Exception:
        return False
    return True


#: The ``(backend, op)`` entries of torch's ``fp32_precision`` API that this torch has.
PRECISION_OPS: tuple[tuple[str, str], ...] = tuple(
    pair
    for pair in (
        ("generic", "all"),
        ("cuda", "all"),
        ("cuda", "matmul"),
        ("cuda", "conv"),
        ("cuda", "rnn"),
        ("mkldnn", "all"),
        ("mkldnn", "matmul"),
        ("mkldnn", "conv"),
        ("mkldnn", "rnn"),
    )
    if _supported(pair)
)
# Read with one ``map`` over a C function: no Python frame per op.
_PRECISION_BACKENDS = tuple(b for b, _ in PRECISION_OPS)
_PRECISION_OPNAMES = tuple(o for _, o in PRECISION_OPS)
_CHILD_BACKENDS = tuple(b for b, o in PRECISION_OPS if o != "all")
_CHILD_OPNAMES = tuple(o for _, o in PRECISION_OPS if o != "all")

# Positions in PRECISION_OPS (when all nine exist).
_GENERIC, _CUDA, _CUDA_MATMUL, _CONV, _RNN, _MKLDNN, _MKLDNN_MATMUL = range(7)
_CHILDREN = (2, 3, 4, 6, 7, 8)
#: Each entry's backend ``all`` (``generic.all`` for itself).
_BACKEND_ALL = (0, 1, 1, 1, 1, 5, 5, 5, 5)
#: cuDNN's initial conv/rnn state, which no setter accepts (see the docstring).
_DEFAULT = "default"


def _version(text: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found[1]), int(found[2])) if found else (0, 0)


#: The nine entries with "none" meaning "inherit" (torch >= 2.9): own values
#: can be found and written back.  Older torches had other values and rules;
#: there the resolved values are captured and written back as they are.
_EXACT = len(PRECISION_OPS) == 9 and _version(torch.__version__) >= (2, 9)

#: What set_float32_matmul_precision writes to cuda.matmul and mkldnn.matmul.
_MATMUL_ENTRIES = {
    "highest": ("ieee", "ieee"),
    "high": ("tf32", "tf32"),
    "medium": ("tf32", "bf16"),
}

#: Only XPU builds keep the oneDNN TF32 flag: elsewhere the getter returns
#: None and the setter warns and ignores it.
_get_onednn: Any
_set_onednn: Any
_get_onednn, _set_onednn = _torch.ONEDNN_ALLOW_TF32.value or (None, None)
_ONEDNN = _get_onednn is not None


#: Taken by whoever writes the precision state here: a probe (which unsets
#: parents for a moment, see the docstring) or a restore.  Held only around
#: torch's C calls, so it cannot deadlock.
_lock = threading.Lock()
#: Odd while the holder of ``_lock`` writes.  Reading needs no lock: a reader
#: that saw it odd, or changed by the end, reads again under the lock, so it
#: never records a probe's passing state (a seqlock; the GIL orders the reads).
_writes = 0
_T = TypeVar("_T")


def _new_lock_in_child() -> None:
    # A fork while another thread held it would leave the child's lock held forever.
    global _lock, _writes
    _lock = threading.Lock()
    _writes = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def _precisions() -> tuple[str, ...]:
    if _get_precision is None:  # a torch without the fp32_precision API
        return ()
    return tuple(map(_get_any, _PRECISION_BACKENDS, _PRECISION_OPNAMES))


def _resolve(own: tuple[str, ...], i: int) -> str:
    """What torch reports for entry ``i`` when the entries hold ``own``
    (``Context::float32Precision``)."""
    value = own[i]
    if value == _DEFAULT:
        value = own[_BACKEND_ALL[i]]
        if value in ("none", _DEFAULT):
            value = own[_GENERIC]
            if value in ("none", _DEFAULT):
                value = "tf32"
    elif value == "none":
        value = own[_BACKEND_ALL[i]]
        if value == "none":
            value = own[_GENERIC]
    if _CUDA <= i <= _RNN and value == "bf16":
        return "none"  # cuda has no bf16
    return value


def _closest(own: tuple[str, ...]) -> str:
    """The writable value that behaves like cuDNN's initial state under the
    parents in ``own``: it follows a set parent like "none", and reads "tf32"
    without one."""
    return "none" if own[_CUDA] != "none" or own[_GENERIC] != "none" else "tf32"


_Hidden = tuple[tuple[str, ...], tuple[str, ...], str | None, bool | None]


def _read(find_default: bool = False) -> _Hidden:
    """The resolved values torch reports, each entry's own value, the legacy
    matmul precision and the legacy cuDNN flag.

    With no parent set, an entry resolves to its own value, except that
    cuDNN's initial state reads "tf32" like an explicit "tf32"; they behave
    alike until a parent is set, so they are told apart only for
    ``find_default``.  Otherwise the parents are unset for a moment (under
    ``_lock``).
    """
    seen = _writes
    if not seen & 1:
        found = _quick(_precisions(), find_default)
        if found is not None and _writes == seen:
            return found
    return _exclusively(lambda: _probe(_precisions(), find_default))


def _exclusively(step: Callable[[], _T]) -> _T:
    """Run ``step`` holding ``_lock``, with ``_writes`` odd meanwhile.

    The ``with`` is one line: CPython gives a ``with``'s exit the statement's
    own line, so with the body on another line a tracer raising at that line
    event would skip the release and leave the lock held for good.
    """
    with _lock: return _counted(step)  # noqa: E701  # fmt: skip


def _counted(step: Callable[[], _T]) -> _T:
    global _writes
    _writes += 1
    try:
        return step()
    finally:
        _writes += 1


def _quick(eff: tuple[str, ...], find_default: bool) -> _Hidden | None:
    """:func:`_read` by reading alone; ``None`` where that cannot tell."""
    if _EXACT and (
        eff[_GENERIC] != "none"
        or eff[_CUDA] != "none"
        or eff[_MKLDNN] != "none"
        or (find_default and "tf32" in (eff[_CONV], eff[_RNN]))
    ):
        return None
    legacy: str | None
    cudnn: bool | None
    try:
        legacy = get_float32_matmul_precision()
    except RuntimeError:
        legacy = _refused_matmul_precision(eff)
    try:
        cudnn = get_cudnn_allow_tf32()
    except RuntimeError:
        if not _EXACT:
            cudnn = None
        elif (eff[_CONV] == "tf32") == (eff[_RNN] == "tf32"):
            cudnn = eff[_CONV] != "tf32"  # it raises exactly when the flag disagrees with both
        else:
            return None  # conv and rnn disagree: only a probe can tell
    return eff, eff, legacy, cudnn


def _probe(eff: tuple[str, ...], find_default: bool) -> _Hidden:
    """:func:`_read` where reading alone cannot tell: the parents are unset for
    a moment and put back.  The caller holds ``_lock``."""
    if not _EXACT:
        return eff, eff, *_legacy(eff, eff)
    found = _quick(eff, find_default)
    if found is not None:  # the read without the lock only met another thread's write
        return found
    assert _get_precision is not None
    assert _set_precision is not None
    get, put = _get_precision, _set_precision
    own = list(eff)
    undo: list[tuple[str, str]] = []  # (backend, value) of each "all" to write back, last first
    try:
        if eff[_GENERIC] != "none":
            undo.append(("generic", eff[_GENERIC]))
            put("generic", "all", "none")
            # With generic.all unset, a backend's "all" reads as its own value.
            own[_CUDA] = get("cuda", "all")
            own[_MKLDNN] = get("mkldnn", "all")
        for i, backend in ((_CUDA, "cuda"), (_MKLDNN, "mkldnn")):
            if own[i] != "none":
                undo.append((backend, own[i]))
                put(backend, "all", "none")
        # Every parent unset: each child reads as its own value (cuDNN's initial
        # state as "tf32", see below).
        for i, value in zip(_CHILDREN, map(get, _CHILD_BACKENDS, _CHILD_OPNAMES), strict=True):
            own[i] = value
        # The legacy getters raise when the matmul (or conv and rnn) entries
        # contradict the legacy fields; a parent set through the new API alone
        # does that on every read (19 µs per raise), the entries alone rarely.
        window = ("none", "none", *own[2:5], "none", *own[6:])
        legacy, cudnn = _legacy(window, window)
        # cuDNN's initial state reads "tf32" but follows a parent: set one.  (With
        # no parent set it behaves as "tf32" and is written so, as by _quick.)
        if (undo or find_default) and "tf32" in (own[_CONV], own[_RNN]):
            if own[_CUDA] == "none":
                undo.append(("cuda", "none"))
            put("cuda", "all", "ieee")
            for i, op in ((_CONV, "conv"), (_RNN, "rnn")):
                if own[i] == "tf32" and get("cuda", op) == "ieee":
                    own[i] = _DEFAULT
    finally:
        _put_back(put, undo)
    return eff, tuple(own), legacy, cudnn


def _put_back(put: Any, undo: list[tuple[str, str]]) -> None:
    """Write back every parent :func:`_probe` unset, last first, even if a signal
    handler raises after one of the writes (each C call is a point where it
    can): that write is made again, the rest follow, then the exception."""
    pending: BaseException | None = None
    for backend, value in reversed(undo):
        try:
            put(backend, "all", value)
        except BaseException as exc:
            pending = pending or exc
            put(backend, "all", value)
    if pending is not None:
        raise pending


def _matmul_refused(legacy: str, cuda: str, mkldnn: str) -> bool:
    """Whether torch's float32_matmul_precision getter raises, given the legacy
    value and the resolved matmul entries (``Context::float32MatmulPrecision``)."""
    return (
        (cuda == "tf32" and legacy == "highest")
        or (mkldnn == "bf16" and legacy != "medium")
        or (mkldnn == "tf32" and legacy != "high")
    )


def _legacy(eff: tuple[str, ...], own: tuple[str, ...]) -> tuple[str | None, bool | None]:
    """The legacy matmul precision and cuDNN TF32 flag, also where torch's
    getters refuse to report them (``None``: cannot be known)."""
    legacy: str | None
    cudnn: bool | None
    try:
        legacy = get_float32_matmul_precision()
    except RuntimeError:
        legacy = _refused_matmul_precision(eff)
    try:
        cudnn = get_cudnn_allow_tf32()
    except RuntimeError:
        cudnn = _refused_cudnn_allow_tf32(eff, own)
    return legacy, cudnn


#: For the resolved (cuda.matmul, mkldnn.matmul): the legacy values torch's
#: getter refuses to report.  Where it raised, the field is one of these.
_REFUSING = {
    (cuda, mkldnn): tuple(
        v for v in ("highest", "high", "medium") if _matmul_refused(v, cuda, mkldnn)
    )
    for cuda in ("none", "ieee", "tf32")
    for mkldnn in ("none", "ieee", "tf32", "bf16")
}


def _refused_matmul_precision(eff: tuple[str, ...]) -> str | None:
    """The legacy matmul precision where its getter raised, with ``eff`` in force."""
    if not _EXACT:
        return None
    cuda = eff[_CUDA_MATMUL]
    found = _REFUSING.get((cuda, eff[_MKLDNN_MATMUL]), ())
    if len(found) > 1:
        # The cuBLAS getter tells "highest" apart: it raises exactly when the
        # field's TF32 and cuda.matmul's disagree.
        try:
            get_cublas_allow_tf32()
            cublas_refused = False
        except RuntimeError:
            cublas_refused = True
        found = tuple(v for v in found if ((v != "highest") != (cuda == "tf32")) == cublas_refused)
    return found[0] if len(found) == 1 else None


def _refused_cudnn_allow_tf32(eff: tuple[str, ...], own: tuple[str, ...]) -> bool | None:
    """The legacy cuDNN TF32 flag where its getter raised, with ``eff`` in force."""
    if not _EXACT:
        return None
    conv, rnn = eff[_CONV] == "tf32", eff[_RNN] == "tf32"
    if conv == rnn:
        return not conv  # it raises exactly when the flag disagrees with both
    # conv and rnn disagree, which hides the flag: make them agree for one call
    # through an entry whose own value is known and writable (not "default").
    i, value = (_CONV, "tf32") if not conv else (_RNN, "tf32")
    if own[i] == _DEFAULT:
        i, value = (_RNN if i == _CONV else _CONV), "ieee"
    assert _set_precision is not None
    _set_precision("cuda", _PRECISION_OPNAMES[i], value)
    try:
        get_cudnn_allow_tf32()
        agrees = True
    except RuntimeError:
        agrees = False
    finally:
        _set_precision("cuda", _PRECISION_OPNAMES[i], own[i])
    return (value == "tf32") == agrees


def _onednn_allow_tf32() -> bool | None:
    return bool(_get_onednn()) if _get_onednn is not None else None


# -- inductor ------------------------------------------------------------------

_INDUCTOR = INDUCTOR_CONFIG
#: ``torch._inductor.config.deterministic`` (inductor's random-number entries
#: are the ``torch.compile`` source's: :mod:`.compiler`).
_ENTRY = ConfigEntry(
    _INDUCTOR, "deterministic", lambda: os.getenv("TORCHINDUCTOR_DETERMINISTIC") == "1"
)
_NOT_IMPORTED = (None, AT_DEFAULT)


def _read_inductor() -> tuple[bool | None, object]:
    """(the value, the override or AT_DEFAULT); (None, AT_DEFAULT) if not imported."""
    value, override = _ENTRY.read()
    return (None if value is None else bool(value)), override


def _apply_inductor(override: object | None = None) -> None:
    """Set inductor's flag, unless ``override`` (just read, or ``None``: read
    now) says it is set already (nested blocks)."""
    if override is None:
        override = _ENTRY.override()
    if override is not True:
        _ENTRY.set(True)


def _restore_inductor(want: object) -> None:
    _ENTRY.restore(want)


# -- the state -----------------------------------------------------------------


class FlagState(NamedTuple):
    """Every flag value.

    ``fp32_precision`` holds what the getters report (resolved values),
    ``fp32_precision_own`` what each entry holds itself (see the module
    docstring); ``float32_matmul_precision`` and ``cudnn_allow_tf32`` are the
    legacy fields, also where torch's getters refuse to report them (``None``:
    unknown, left alone by a restore).  ``inductor_deterministic`` is the
    value (``None`` if inductor is not imported), ``inductor_override`` what
    restoring writes: :data:`AT_DEFAULT` or the value someone set.
    """

    cudnn_deterministic: bool
    cudnn_benchmark: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    fill_uninitialized_memory: bool
    mkldnn_deterministic: bool
    inductor_deterministic: bool | None
    float32_matmul_precision: str | None
    fp32_precision: tuple[str, ...]
    fp32_precision_own: tuple[str, ...]
    cudnn_allow_tf32: bool | None
    onednn_allow_tf32: bool | None
    inductor_override: object


# -- the boolean flags -----------------------------------------------------------


def _set_deterministic_algorithms(on: bool) -> None:
    # torch writes the mode and warn_only together: keep warn_only as it is
    # (left out, it is written False, and the call costs 0.1 µs less).
    if get_deterministic_algorithms_warn_only():
        set_deterministic_algorithms(on, warn_only=True)
    else:
        set_deterministic_algorithms(on)


def _set_deterministic_warn_only(warn_only: bool) -> None:
    # Likewise, keep the mode as it is.
    set_deterministic_algorithms(get_deterministic_algorithms(), warn_only=warn_only)


class _Flag(NamedTuple):
    """A boolean flag: its field of :class:`FlagState` (and key in a checkpoint),
    its getter and setter, and its value inside a block (``None``: the block's
    ``warn_only``)."""

    field: str
    get: Callable[[], bool]
    set: Callable[[bool], None]
    inside: bool | None


def _absent_get() -> bool:
    return False


def _absent_set(value: bool) -> None:
    return None


def _optional_flag(field: str, capability: _torch.Capability, inside: bool) -> _Flag:
    """A flag that not every torch has: where this one lacks it (see ``capability``),
    it reads ``False`` (an older torch behaves as if it were off: it never fills
    memory, oneDNN has no switch of its own), is never written, and a block
    leaves it ``False`` too."""
    found = capability.value
    if found is None:
        return _Flag(field, _absent_get, _absent_set, False)
    get, put = found
    return _Flag(field, get, put, inside)


#: The boolean flags, in :class:`FlagState`'s order (its first fields).
_FLAGS = (
    _Flag("cudnn_deterministic", get_cudnn_deterministic, set_cudnn_deterministic, True),
    _Flag("cudnn_benchmark", get_cudnn_benchmark, set_cudnn_benchmark, False),
    _Flag(
        "deterministic_algorithms",
        get_deterministic_algorithms,
        _set_deterministic_algorithms,
        True,
    ),
    _Flag(
        "deterministic_warn_only",
        get_deterministic_algorithms_warn_only,
        _set_deterministic_warn_only,
        None,
    ),
    _optional_flag("fill_uninitialized_memory", _torch.FILL_UNINITIALIZED_MEMORY, True),
    _optional_flag("mkldnn_deterministic", _torch.MKLDNN_DETERMINISTIC, True),
)
_BOOLS = tuple(flag.field for flag in _FLAGS)
#: The flags this torch lacks: held ``False`` in every state, never written.
UNSUPPORTED_FLAGS: frozenset[str] = frozenset(
    flag.field for flag in _FLAGS if flag.get is _absent_get
)
_MODE, _WARN_ONLY = (
    _BOOLS.index("deterministic_algorithms"),
    _BOOLS.index("deterministic_warn_only"),
)
assert FlagState._fields[: len(_BOOLS)] == _BOOLS
# Plain tuples for the hot loops: a row's attribute, or zip(), costs more.
_GETTERS = tuple(flag.get for flag in _FLAGS)
#: ``_call(f)`` is ``f()``: with ``map``, the getters run without a Python frame each.
_call: Callable[[Callable[[], Any]], Any] = getattr(operator, "call", lambda f: f())
_ACCESS = tuple((flag.get, flag.set, i) for i, flag in enumerate(_FLAGS))
_FILL = _BOOLS.index("fill_uninitialized_memory")
#: The flags' values inside a block, by its ``(warn_only, fill_uninitialized_memory)``.
_INSIDE = {
    (warn_only, fill): tuple(
        warn_only
        if flag.inside is None
        else fill
        if i == _FILL and flag.get is not _absent_get
        else flag.inside
        for i, flag in enumerate(_FLAGS)
    )
    for warn_only in (False, True)
    for fill in (False, True)
}


def _write_flags(values: tuple[Any, ...]) -> None:
    """Write each flag that differs from its value in ``values`` (one of
    :data:`_INSIDE`), reading it just before: a write of the mode or of
    warn_only writes the other too."""
    for get, put, i in _ACCESS:
        if get() != values[i]:
            put(values[i])


#: The flags each written by a setter of its own (all but the mode and warn_only pair).
_SINGLE: tuple[tuple[Callable[[Any], None], int], ...] = tuple(
    (flag.set, i) for i, flag in enumerate(_FLAGS) if i not in (_MODE, _WARN_ONLY)
)


def _write_changed_flags(values: tuple[Any, ...], now: tuple[Any, ...]) -> None:
    """Write each flag whose value in ``values`` differs from ``now`` (just read)."""
    for put, i in _SINGLE:
        if now[i] != values[i]:
            put(values[i])
    if now[_MODE] != values[_MODE] or now[_WARN_ONLY] != values[_WARN_ONLY]:
        set_deterministic_algorithms(values[_MODE], warn_only=values[_WARN_ONLY])


# -- the source ----------------------------------------------------------------


class TorchFlagsSource:
    """Algorithm-selection flags of torch, cuDNN, oneDNN and inductor, and the
    TF32/precision flags, restored exactly."""

    name = "torch.flags"
    #: The slot of the fused plan (sources/fused.py) this exact class fills.
    fused_slot = "flags"
    device_type: str | None = None  # not a device generator: saved under "sources"

    def capture(self) -> FlagState:
        inductor, override = _read_inductor() if _INDUCTOR in sys.modules else _NOT_IMPORTED
        # The common case inline (no parent entry set, the legacy getters
        # answer, no write in another thread meanwhile): what _read() returns
        # there, without its three calls; anything else takes _read().
        seen = _writes
        eff = tuple(map(_get_any, _PRECISION_BACKENDS, _PRECISION_OPNAMES)) if _EXACT else ()
        if _EXACT and not seen & 1 and eff[_GENERIC] == eff[_CUDA] == eff[_MKLDNN] == "none":
            try:
                legacy: str | None = get_float32_matmul_precision()
                cudnn: bool | None = get_cudnn_allow_tf32()
            except RuntimeError:
                eff, own, legacy, cudnn = _read()
            else:
                own = eff
                if _writes != seen:
                    eff, own, legacy, cudnn = _read()
        else:
            eff, own, legacy, cudnn = _read()
        values = list(map(_call, _GETTERS))  # C-level calls, no Python frame each
        onednn = _onednn_allow_tf32() if _ONEDNN else None
        values += (inductor, legacy, eff, own, cudnn, onednn, override)
        # FlagState._make without its length check, a Python call (0.1-0.2 µs):
        # the flags' fields, then these seven.
        return tuple.__new__(FlagState, values)

    def apply(self, settings: Settings) -> None:
        if not settings.flags:  # the caller's flags, captured and restored all the same
            return
        _write_flags(_INSIDE[settings.warn_only, settings.fill_uninitialized_memory])
        if _INDUCTOR in sys.modules:
            _apply_inductor()

    def apply_after_capture(self, state: FlagState, settings: Settings) -> None:
        """:meth:`apply`, for a state :meth:`capture` has just returned: the
        flags are compared with it instead of being read again."""
        if not settings.flags:
            return
        _write_changed_flags(_INSIDE[settings.warn_only, settings.fill_uninitialized_memory], state)
        if _INDUCTOR in sys.modules:
            # Captured just now, and imported then too: its override is known.
            known = state.inductor_deterministic is not None
            _apply_inductor(state.inductor_override if known else None)

    def restore(self, state: FlagState) -> None:
        if _INDUCTOR in sys.modules:
            _restore_inductor(state.inductor_override)
        # Every flag written, none read: each setter only stores its value, so
        # writing an unchanged one is a no-op, and five C calls cost less than
        # six reads and the writes they find needed.  The mode and warn_only
        # are written together, by one call.
        for put, i in _SINGLE:
            put(state[i])
        set_deterministic_algorithms(state[_MODE], warn_only=state[_WARN_ONLY])
        # The common case of _restore_precision inline: no parent set in the
        # target, so the entries read back as their own values; if they and
        # the legacy fields are as captured, there is nothing to write.
        want = state.fp32_precision_own
        seen = _writes
        if (
            _EXACT
            and not _ONEDNN
            and not seen & 1
            and want[_GENERIC] == want[_CUDA] == want[_MKLDNN] == "none"
            and _DEFAULT not in (want[_CONV], want[_RNN])
            and tuple(map(_get_any, _PRECISION_BACKENDS, _PRECISION_OPNAMES)) == want
        ):
            try:
                unchanged = state.float32_matmul_precision in (
                    None,
                    get_float32_matmul_precision(),
                ) and state.cudnn_allow_tf32 in (None, get_cudnn_allow_tf32())
            except RuntimeError:
                unchanged = False
            if unchanged and _writes == seen:
                return
        _restore_precision(state)

    def restore_over(self, state: FlagState, now: FlagState) -> None:
        """:meth:`restore`, where :meth:`capture` has just returned ``now``
        (a swap of two worlds): the flags that differ are written, none is
        read again, and the precision state is written only if it differs."""
        if _INDUCTOR in sys.modules:
            _restore_inductor(state.inductor_override)
        _write_changed_flags(state, now)
        if (
            state.fp32_precision_own != now.fp32_precision_own
            or state.float32_matmul_precision not in (None, now.float32_matmul_precision)
            or state.cudnn_allow_tf32 not in (None, now.cudnn_allow_tf32)
            or _ONEDNN
        ):
            _restore_precision(state)

    def export_state(self, state: FlagState) -> dict[str, Any]:
        """The state as plain data: one entry per field, ``fp32_precision`` as
        ``{"backend.op": own value}`` (cuDNN's initial state as the value that
        behaves the same), ``inductor_deterministic`` only if someone set it,
        ``cudnn_allow_tf32`` if known, ``onednn_allow_tf32`` on builds that have it.
        """
        out: dict[str, Any] = {f: getattr(state, f) for f in _BOOLS}
        if state.inductor_override != AT_DEFAULT:
            out["inductor_deterministic"] = _saved_override(state.inductor_override)
        out["float32_matmul_precision"] = _saved_matmul_precision(state)
        out["fp32_precision"] = _saved_entries(state.fp32_precision_own)
        for f in _OPTIONAL_BOOLS:
            if (value := getattr(state, f)) is not None:
                out[f] = value
        return out

    def import_state(self, data: object, path: str) -> FlagState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field.

        The saved ``fp32_precision`` entries must be exactly this torch's, each
        a value its setter accepts: a flag that could not be restored is an
        error, not a skip.  Files written before ``cudnn_allow_tf32`` was saved
        load too: that flag is then left as it is.
        """
        d = _plain.fields(
            data,
            path,
            [*_BOOLS, "float32_matmul_precision", "fp32_precision"],
            ["inductor_deterministic", *_OPTIONAL_BOOLS],
        )
        precision = _plain.fields(d["fp32_precision"], f"{path}.fp32_precision", _PRECISION_KEYS)

        def flag(name: str) -> bool:
            return _plain.flag(d[name], f"{path}.{name}")

        def optional(name: str) -> bool | None:
            return flag(name) if name in d else None

        legacy = _plain.text(
            d["float32_matmul_precision"],
            f"{path}.float32_matmul_precision",
            choices=("highest", "high", "medium"),
        )
        own = _loaded_entries(precision, f"{path}.fp32_precision")
        eff = tuple(_resolve(own, i) for i in range(len(own))) if _EXACT else own
        if _EXACT:
            _check_matmul_precision(legacy, eff, f"{path}.fp32_precision")
        onednn = optional("onednn_allow_tf32")
        if onednn is not None and not _ONEDNN:
            raise ValueError(
                f"{path}.onednn_allow_tf32: this torch build has no oneDNN TF32 flag "
                f"(only XPU builds keep it), so it cannot be restored"
            )
        inductor = optional("inductor_deterministic")
        flags = [flag(f) for f in _BOOLS]  # FlagState's first fields
        cudnn = optional("cudnn_allow_tf32")
        override = AT_DEFAULT if inductor is None else inductor
        return FlagState._make((*flags, inductor, legacy, eff, own, cudnn, onednn, override))


# -- saving and loading ------------------------------------------------------------

#: The legacy TF32 flags: saved where known (not ``None``), optional in a file.
_OPTIONAL_BOOLS = ("cudnn_allow_tf32", "onednn_allow_tf32")


def _saved_override(override: object) -> bool:
    """Inductor's override as saved: only a bool can be."""
    if type(override) is not bool:
        raise ValueError(
            f"{_INDUCTOR}.deterministic holds {override!r}, not True or "
            f"False, so these flags cannot be saved"
        )
    return override


def _saved_matmul_precision(state: FlagState) -> str:
    """The legacy matmul precision as saved: only a value torch can report."""
    own = state.fp32_precision_own
    legacy = state.float32_matmul_precision
    if legacy is None or (
        _EXACT
        and _matmul_refused(legacy, _resolve(own, _CUDA_MATMUL), _resolve(own, _MKLDNN_MATMUL))
    ):
        raise ValueError(
            "torch cannot report its float32 matmul precision (the legacy allow_tf32 and "
            "the new fp32_precision APIs were mixed), so these flags cannot be saved; "
            "set them through one API only"
        )
    return legacy


def _saved_entries(own: tuple[str, ...]) -> dict[str, str]:
    """The entries as saved: ``{"backend.op": own value}``."""
    if _EXACT:  # cuDNN's initial state cannot be loaded: save what behaves the same
        closest = _closest(own)
        own = tuple(closest if value == _DEFAULT else value for value in own)
    return dict(zip(_PRECISION_KEYS, own, strict=True))


def _loaded_entries(precision: dict[str, Any], path: str) -> tuple[str, ...]:
    """The checked own values of the saved ``fp32_precision`` entries."""
    for key in _PRECISION_KEYS:
        value = _plain.text(precision[key], f"{path}.{key}", choices=_FP32_VALUES)
        if key.startswith("cuda.") and value == "bf16":
            raise ValueError(f"{path}.{key}: torch refuses {value!r} there")
    return tuple(precision[key] for key in _PRECISION_KEYS)


def _check_matmul_precision(legacy: str, eff: tuple[str, ...], path: str) -> None:
    """Refuse what torch sets but then refuses to read back ("mix of the legacy
    and new APIs"); saving refuses it too."""
    cuda, mkldnn = eff[_CUDA_MATMUL], eff[_MKLDNN_MATMUL]
    if _matmul_refused(legacy, cuda, mkldnn):
        backend, effective = ("mkldnn", mkldnn) if mkldnn in ("tf32", "bf16") else ("cuda", cuda)
        raise ValueError(
            f"{path}: torch refuses {backend} matmul precision "
            f"{effective!r} together with float32_matmul_precision={legacy!r}"
        )


# -- restoring the precision ---------------------------------------------------------


def _restore_precision(state: FlagState) -> None:
    """Put back the precision state of ``state``, if the body changed it."""
    want = state.fp32_precision_own
    # A "tf32" read with no parent set may be cuDNN's initial state: that
    # matters where the target sets a cuda parent (they differ under it) or holds it.
    find_default = _EXACT and (
        want[_GENERIC] != "none" or want[_CUDA] != "none" or _DEFAULT in (want[_CONV], want[_RNN])
    )
    _, own, legacy, cudnn = _read(find_default)
    if (
        own == want
        and state.float32_matmul_precision in (None, legacy)
        and state.cudnn_allow_tf32 in (None, cudnn)
        and not _ONEDNN
    ):
        return  # the common case: the body changed no precision

    def write() -> None:
        # Read again: another thread may have written since.
        _, own, legacy, cudnn = _probe(_precisions(), find_default)
        _write_precision(state, own, legacy, cudnn)

    _exclusively(write)


def _write_precision(
    state: FlagState, own: tuple[str, ...], legacy: str | None, cudnn: bool | None
) -> None:
    """Write what differs between ``state`` and the current ``own``, ``legacy``
    and ``cudnn``.  The caller holds ``_lock``."""
    # The legacy setters first: they overwrite entries, which are fixed after.
    entries = _write_legacy(state, own, legacy, cudnn)
    if entries != state.fp32_precision_own:
        _write_entries(state.fp32_precision_own, entries)


def _write_legacy(
    state: FlagState, own: tuple[str, ...], legacy: str | None, cudnn: bool | None
) -> tuple[str, ...]:
    """Write the legacy fields that differ from ``legacy``, ``cudnn`` and the
    oneDNN flag; the entries' own values after."""
    written: dict[int, str] = {}  # by position in PRECISION_OPS, what the setters wrote
    if state.float32_matmul_precision not in (None, legacy):
        set_float32_matmul_precision(state.float32_matmul_precision)
        matmul = _MATMUL_ENTRIES[state.float32_matmul_precision]
        written[_CUDA_MATMUL], written[_MKLDNN_MATMUL] = matmul
    if state.cudnn_allow_tf32 not in (None, cudnn):
        set_cudnn_allow_tf32(state.cudnn_allow_tf32)
        written[_CONV] = written[_RNN] = "tf32" if state.cudnn_allow_tf32 else "none"
    if _ONEDNN and state.onednn_allow_tf32 not in (None, _onednn_allow_tf32()):
        _set_onednn(state.onednn_allow_tf32)
    if written and not _EXACT:
        return _precisions()  # older rules: read what the setters wrote
    return tuple(written.get(i, value) for i, value in enumerate(own))


def _write_entries(want: tuple[str, ...], entries: tuple[str, ...]) -> None:
    """Write the entries whose own values differ from ``want``."""
    assert _set_precision is not None
    if not _EXACT:
        # Older rules: write every resolved value, parents first.
        for op, value in zip(PRECISION_OPS, want, strict=True):
            _set_precision(*op, value)
        return
    # Entries are separate cells: once the legacy fields are written, the
    # order of these writes does not matter.
    closest = _closest(want)
    for op, target, have in zip(PRECISION_OPS, want, entries, strict=True):
        write = _entry_write(target, have, closest)
        if write is not None:
            _set_precision(*op, write)


def _entry_write(target: str, have: str, closest: str) -> str | None:
    """What to write to an entry that holds ``have`` for it to hold ``target``
    (``closest``: what behaves as cuDNN's initial state under the target's
    parents); ``None``: nothing."""
    if target == _DEFAULT:
        target = closest  # no setter takes it
    if target == have or (have == _DEFAULT and target == closest):
        return None  # a kept initial state behaves as the target under the target's parents
    return target


_PRECISION_KEYS = tuple(f"{backend}.{op}" for backend, op in PRECISION_OPS)
_FP32_VALUES = ("none", "ieee", "tf32", "bf16")
