"""The float32 matmul / TF32 precision state of torch, captured and restored exactly.

Its one job: the precision part of the flags' state (:data:`Precision`: the
``fp32_precision`` entries, the legacy ``float32_matmul_precision`` and
``allow_tf32`` fields): reading the effective and own values, the refusal
rules of torch's getters, writing the state back, and saving and loading it.
:mod:`.flags` holds the boolean determinism flags and the source.

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
  it; the field is then read with both matmul entries unset for one call.
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
"""

from __future__ import annotations

import os
import threading
from itertools import repeat, starmap
from typing import Any

import torch

from .. import _torch
from .._torch.flags import (
    get_cudnn_allow_tf32,
    get_float32_matmul_precision,
    set_cudnn_allow_tf32,
    set_float32_matmul_precision,
)
from ..base import plain as _plain
from ..base.completion import complete_each

__all__ = [
    "OPTIONAL_PRECISION",
    "PRECISION_OPS",
    "Precision",
    "capture_precision",
    "export_precision",
    "import_precision",
    "restore_precision",
]

_get_precision: Any
_set_precision: Any
_get_precision, _set_precision = _torch.FP32_PRECISION.value or (None, None)


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
# Positions in PRECISION_OPS (when all nine exist).
GENERIC, CUDA, _CUDA_MATMUL, CONV, RNN, MKLDNN, _MKLDNN_MATMUL = range(7)
#: Each entry's backend ``all`` (``generic.all`` for itself).
_BACKEND_ALL = (0, 1, 1, 1, 1, 5, 5, 5, 5)
#: cuDNN's initial conv/rnn state, which no setter accepts (see the docstring).
DEFAULT = "default"


#: The nine entries with "none" meaning "inherit" (torch >= 2.9): own values
#: can be found and written back.  Older torches had other values and rules;
#: there the resolved values are captured and written back as they are.
EXACT = len(PRECISION_OPS) == 9 and _torch.release_of(torch.__version__) >= (2, 9)

#: What set_float32_matmul_precision accepts.
_MATMUL_VALUES = ("highest", "high", "medium")

#: Only XPU builds keep the oneDNN TF32 flag: elsewhere the getter returns
#: None and the setter warns and ignores it.
_get_onednn: Any
_set_onednn: Any
_get_onednn, _set_onednn = _torch.ONEDNN_ALLOW_TF32.value or (None, None)
ONEDNN = _get_onednn is not None


#: Held by every read and write of the precision state here: a read may unset
#: parents for a moment (see the docstring), which no other thread's read may
#: record or undo.  Uncontended, taking it costs about one C call.  Re-entrant:
#: a signal handler that enters a block while its thread holds it goes on.
#: Held only around torch's C calls, so it cannot deadlock.
_lock = threading.RLock()
if hasattr(os, "register_at_fork"):
    # A fork while another thread held it would leave the child's lock held forever.
    os.register_at_fork(after_in_child=_lock._at_fork_reinit)  # type: ignore[attr-defined]


def resolve(own: tuple[str, ...], i: int) -> str:
    """What torch reports for entry ``i`` when the entries hold ``own``
    (``Context::float32Precision``)."""
    value = own[i]
    if value in ("none", DEFAULT):  # inherited (no "all" entry is ever DEFAULT)
        inherited = own[_BACKEND_ALL[i]]
        if inherited == "none":
            inherited = own[GENERIC]
        value = "tf32" if value == DEFAULT and inherited == "none" else inherited
    if CUDA <= i <= RNN and value == "bf16":
        return "none"  # cuda has no bf16
    return value


def _closest(own: tuple[str, ...]) -> str:
    """The writable value that behaves like cuDNN's initial state under the
    parents in ``own``: it follows a set parent like "none", and reads "tf32"
    without one."""
    return "none" if own[CUDA] != "none" or own[GENERIC] != "none" else "tf32"


_Own = tuple[str, ...]
_Hidden = tuple[_Own, _Own, str | None, bool | None]
#: The precision state, in the flags' state's order (its fields
#: ``float32_matmul_precision`` to ``onednn_allow_tf32``): the legacy matmul
#: precision, the resolved and the own ``fp32_precision`` entries, the legacy
#: cuDNN and oneDNN TF32 flags (``None``: unknown, left alone by a restore).
Precision = tuple[str | None, _Own, _Own, bool | None, bool | None]


def capture_precision() -> Precision:
    """The precision state now.

    The ``with`` is one line: CPython gives a ``with``'s exit the statement's
    own line, so with the body on another line a tracer raising at that line
    event would skip the release and leave the lock held for good.
    """
    with _lock: eff, own, legacy, cudnn = _read(False)  # noqa: E701  # fmt: skip
    return legacy, eff, own, cudnn, bool(_get_onednn()) if ONEDNN else None


def _read(find_default: bool) -> _Hidden:
    """The resolved values torch reports, each entry's own value, the legacy
    matmul precision and the legacy cuDNN flag; the caller holds ``_lock``.

    With no parent set, an entry resolves to its own value, except that
    cuDNN's initial state reads "tf32" like an explicit "tf32"; they behave
    alike until a parent is set, so they are told apart only for
    ``find_default``.  Otherwise the parents are unset for a moment and put
    back.  (Older torches: the resolved values are all that is known.)
    """
    # C calls, no Python frame per entry (no entry on a torch without the API).
    eff = tuple(starmap(_get_precision, PRECISION_OPS))
    if not EXACT or (
        eff[GENERIC] == eff[CUDA] == eff[MKLDNN] == "none"
        and not (find_default and "tf32" in (eff[CONV], eff[RNN]))
    ):
        return eff, eff, *_legacy(eff)
    assert _get_precision is not None
    assert _set_precision is not None
    get, put = _get_precision, _set_precision
    own = list(eff)
    undo: list[tuple[str, str, str]] = []  # (backend, "all", value) to write back, last first
    try:
        if eff[GENERIC] != "none":
            undo.append(("generic", "all", eff[GENERIC]))
            put("generic", "all", "none")
            # With generic.all unset, a backend's "all" reads as its own value.
            own[CUDA] = get("cuda", "all")
            own[MKLDNN] = get("mkldnn", "all")
        for i, backend in ((CUDA, "cuda"), (MKLDNN, "mkldnn")):
            if own[i] != "none":
                undo.append((backend, "all", own[i]))
                put(backend, "all", "none")
        # Every parent unset: each child reads as its own value (cuDNN's initial
        # state as "tf32", see below).
        window = tuple(starmap(get, PRECISION_OPS))
        own[2:5], own[6:] = window[2:5], window[6:]
        # The legacy getters raise when the matmul (or conv and rnn) entries
        # contradict the legacy fields; a parent set through the new API alone
        # does that on every read (19 µs per raise), the entries alone rarely.
        legacy, cudnn = _legacy(window)
        # cuDNN's initial state reads "tf32" but follows a parent: set one.  (With
        # no parent set it behaves as "tf32" and is written so, as above.)
        if "tf32" in (own[CONV], own[RNN]):
            if own[CUDA] == "none":
                undo.append(("cuda", "all", "none"))
            put("cuda", "all", "ieee")
            for i, op in ((CONV, "conv"), (RNN, "rnn")):
                if own[i] == "tf32" and get("cuda", op) == "ieee":
                    own[i] = DEFAULT
    finally:
        _put_back(put, undo)
    return eff, tuple(own), legacy, cudnn


def _put_back(put: Any, undo: list[tuple[str, str, str]]) -> None:
    """Write back every ``(backend, op, value)`` in ``undo``, last first, even if
    a signal handler raises after one of the writes (each C call is a point
    where it can): that write is made again, the rest follow, then the first
    exception.  A write that fails again is left: the rest still follow."""

    def write(entry: tuple[str, str, str]) -> None:
        put(*entry)

    failures = complete_each(zip(repeat(write), reversed(undo)))
    if failures:
        raise failures[0][1]


def _read_with(entries: tuple[int, ...], value: str, eff: tuple[str, ...], get: Any) -> Any:
    """``get()`` with the ``entries`` set to ``value`` for the call, then put back
    to ``eff`` (their own values: no parent is set); ``None`` where it raises."""
    assert _set_precision is not None
    undo = [(*PRECISION_OPS[i], eff[i]) for i in entries]
    try:
        for i in entries:
            _set_precision(*PRECISION_OPS[i], value)
        return get()
    except RuntimeError:
        return None
    finally:
        _put_back(_set_precision, undo)


def _matmul_refused(legacy: str, cuda: str, mkldnn: str) -> bool:
    """Whether torch's float32_matmul_precision getter raises, given the legacy
    value and the resolved matmul entries (``Context::float32MatmulPrecision``)."""
    return (
        (cuda == "tf32" and legacy == "highest")
        or (mkldnn == "bf16" and legacy != "medium")
        or (mkldnn == "tf32" and legacy != "high")
    )


def _legacy(eff: tuple[str, ...]) -> tuple[str | None, bool | None]:
    """The legacy matmul precision and cuDNN TF32 flag, also where torch's
    getters refuse to report them (``None``: cannot be known), with ``eff``
    in force and (torch >= 2.9) no parent set.  The caller holds ``_lock``."""
    legacy: str | None
    cudnn: bool | None
    try:
        legacy = get_float32_matmul_precision()
    except RuntimeError:
        # The matmul entries contradict the field, which hides it: with both
        # unset (and no parent set) the getter answers.
        matmul = (_CUDA_MATMUL, _MKLDNN_MATMUL)
        legacy = _read_with(matmul, "none", eff, get_float32_matmul_precision) if EXACT else None
    try:
        cudnn = get_cudnn_allow_tf32()
    except RuntimeError:
        if not EXACT:
            cudnn = None
        elif (eff[CONV] == "tf32") == (eff[RNN] == "tf32"):
            cudnn = eff[CONV] != "tf32"  # it raises exactly when the flag disagrees with both
        else:
            # conv and rnn disagree, which hides the flag: make them agree for one
            # call.  The one not reading "tf32" is set to it: with no parent set it
            # reads its own value (not cuDNN's initial state, which reads "tf32").
            hidden = (CONV if eff[CONV] != "tf32" else RNN,)
            cudnn = _read_with(hidden, "tf32", eff, get_cudnn_allow_tf32) is not None
    return legacy, cudnn


# -- saving and loading ------------------------------------------------------------


def export_precision(state: Precision) -> dict[str, Any]:
    """``float32_matmul_precision`` (only a value torch can report) and
    ``fp32_precision``: ``{"backend.op": own value}``, cuDNN's initial state
    as the value that behaves the same (it cannot be loaded)."""
    legacy, _, own, *optional = state
    if legacy is None or (
        EXACT and _matmul_refused(legacy, resolve(own, _CUDA_MATMUL), resolve(own, _MKLDNN_MATMUL))
    ):
        raise ValueError(
            "torch cannot report its float32 matmul precision (the legacy allow_tf32 and "
            "the new fp32_precision APIs were mixed), so these flags cannot be saved; "
            "set them through one API only"
        )
    if EXACT:
        closest = _closest(own)
        own = tuple(closest if value == DEFAULT else value for value in own)
    out: dict[str, Any] = {"float32_matmul_precision": legacy}
    out["fp32_precision"] = dict(zip(PRECISION_KEYS, own, strict=True))
    for f, value in zip(OPTIONAL_PRECISION, optional, strict=True):
        if value is not None:  # where known (and the oneDNN flag where the build has it)
            out[f] = value
    return out


def import_precision(d: dict[str, Any], path: str) -> Precision:
    """The state checked from what :func:`export_precision` saved in ``d``.

    The entries must be exactly this torch's, each a value its setter
    accepts, and no mix torch sets but then refuses to read back ("mix of the
    legacy and new APIs"; saving refuses it too): a flag that could not be
    restored is an error, not a skip.  Files written before
    ``cudnn_allow_tf32`` was saved load too: that flag is then left as it is.
    """
    cudnn, onednn = (
        _plain.flag(d[f], f"{path}.{f}") if f in d else None for f in OPTIONAL_PRECISION
    )
    if onednn is not None and not ONEDNN:
        raise ValueError(
            f"{path}.onednn_allow_tf32: this torch build has no oneDNN TF32 flag "
            f"(only XPU builds keep it), so it cannot be restored"
        )
    where = f"{path}.fp32_precision"
    precision = _plain.fields(d["fp32_precision"], where, PRECISION_KEYS)
    legacy = _plain.text(
        d["float32_matmul_precision"], f"{path}.float32_matmul_precision", choices=_MATMUL_VALUES
    )
    for key in PRECISION_KEYS:
        value = _plain.text(precision[key], f"{where}.{key}", choices=_FP32_VALUES)
        if key.startswith("cuda.") and value == "bf16":
            raise ValueError(f"{where}.{key}: torch refuses {value!r} there")
    own = tuple(precision[key] for key in PRECISION_KEYS)
    if not EXACT:
        return legacy, own, own, cudnn, onednn
    eff = tuple(resolve(own, i) for i in range(len(own)))
    cuda, mkldnn = eff[_CUDA_MATMUL], eff[_MKLDNN_MATMUL]
    if _matmul_refused(legacy, cuda, mkldnn):
        backend, effective = ("mkldnn", mkldnn) if mkldnn in ("tf32", "bf16") else ("cuda", cuda)
        raise ValueError(
            f"{where}: torch refuses {backend} matmul precision "
            f"{effective!r} together with float32_matmul_precision={legacy!r}"
        )
    return legacy, eff, own, cudnn, onednn


# -- restoring the precision ---------------------------------------------------------


def restore_precision(state: Precision) -> None:
    """Put back ``state``, if the body changed it: the legacy fields first
    (their setters overwrite entries), then each entry whose own value
    differs.  The ``with`` is one line (see :func:`capture_precision`)."""
    with _lock: _restore(state)  # noqa: E701  # fmt: skip


def _restore(state: Precision) -> None:
    saved_legacy, _, want, saved_cudnn, saved_onednn = state
    # A "tf32" read with no parent set may be cuDNN's initial state: that
    # matters where the target sets a cuda parent (they differ under it) or holds it.
    find_default = EXACT and (
        want[GENERIC] != "none" or want[CUDA] != "none" or DEFAULT in (want[CONV], want[RNN])
    )
    _, own, legacy, cudnn = _read(find_default)
    onednn = bool(_get_onednn()) if ONEDNN else None
    if (
        own == want
        and saved_legacy in (None, legacy)
        and saved_cudnn in (None, cudnn)
        and saved_onednn in (None, onednn)
    ):
        return  # the common case: the body changed no precision
    if saved_legacy not in (None, legacy):
        set_float32_matmul_precision(saved_legacy)
    if saved_cudnn not in (None, cudnn):
        set_cudnn_allow_tf32(saved_cudnn)
    if saved_onednn not in (None, onednn):
        _set_onednn(saved_onednn)
    if not EXACT:
        # Older rules: where any resolved value differs, write every one, parents first.
        if tuple(starmap(_get_precision, PRECISION_OPS)) != want:
            for op, value in zip(PRECISION_OPS, want, strict=True):
                _set_precision(*op, value)
        return
    # The legacy setters overwrite entries: read what they left.  Entries are
    # separate cells: the order of these writes does not matter.  cuDNN's
    # initial state takes no setter: it is written as what behaves the same
    # under the target's parents, and a kept one already does.
    own = _read(find_default)[1]
    closest = _closest(want)
    for op, target, have in zip(PRECISION_OPS, want, own, strict=True):
        if target == DEFAULT:
            target = closest
        if target != have and not (have == DEFAULT and target == closest):
            _set_precision(*op, target)


#: The legacy TF32 flags: saved where known (not ``None``), optional in a file.
OPTIONAL_PRECISION = ("cudnn_allow_tf32", "onednn_allow_tf32")
PRECISION_KEYS = tuple(f"{backend}.{op}" for backend, op in PRECISION_OPS)
_FP32_VALUES = ("none", "ieee", "tf32", "bf16")
