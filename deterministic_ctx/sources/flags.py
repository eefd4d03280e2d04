"""torch determinism flags, restored exactly.

A block sets the boolean flags (they choose *which* algorithm runs), each
to its row's value in ``_FLAGS``, and ``torch._inductor.config.deterministic``
*only if inductor is already imported*: ``use_deterministic_algorithms``
imports it (~1.2 s) to set this; we call the C setter directly and never
import it ourselves.  That flag's state is the entry's *user override* (see
:mod:`.config_entries`): if inductor is first imported inside a block, the
override is cleared on exit, as if the block had never touched it.

**Precision** (:data:`~.precision.Precision`) is part of :class:`FlagState`,
captured and restored but never changed; :mod:`.precision` holds its machinery.

``torch.backends.cudnn.flags()`` is not used: it defaults to ``enabled=False``
and would turn cuDNN off.
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from .. import _torch
from .._torch.flags import (
    get_cudnn_benchmark,
    get_cudnn_deterministic,
    get_deterministic_algorithms,
    get_deterministic_algorithms_warn_only,
    set_cudnn_benchmark,
    set_cudnn_deterministic,
    set_deterministic_algorithms,
)
from .._torch.internals import INDUCTOR_CONFIG as _INDUCTOR
from ..base import plain as _plain
from ..base.settings import Settings
from ._base import SettingSource
from .config_entries import AT_DEFAULT, ConfigEntry
from .precision import (
    OPTIONAL_PRECISION,
    PRECISION_OPS,
    capture_precision,
    export_precision,
    import_precision,
    restore_precision,
)

__all__ = [
    "PRECISION_OPS",
    "UNSUPPORTED_FLAGS",
    "FlagState",
    "TorchFlagsSource",
    "read_alerts",
    "write_alerts",
]


#: ``torch._inductor.config.deterministic`` (inductor's random-number entries
#: are the ``torch.compile`` source's: :mod:`.compiler`).
_ENTRY = ConfigEntry(
    _INDUCTOR, "deterministic", lambda: os.getenv("TORCHINDUCTOR_DETERMINISTIC") == "1"
)


class FlagState(NamedTuple):
    """Every flag value.

    ``float32_matmul_precision`` to ``onednn_allow_tf32`` are
    :data:`~.precision.Precision`.  ``inductor_deterministic`` is the value
    (``None`` if inductor is not imported), ``inductor_override`` what
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


class _Flag(NamedTuple):
    """A boolean flag: its field of :class:`FlagState` (and key in a checkpoint),
    its getter and setter (``None``: the mode and warn_only, written together
    by :func:`_write_flags`), and its value inside a block: ``True`` or
    ``False``, or the name of the block's :class:`Settings` field that holds it."""

    field: str
    get: Callable[[], bool]
    set: Callable[[bool], None] | None
    inside: bool | str


def _optional_flag(field: str, capability: _torch.Capability, inside: bool | str) -> _Flag:
    """A flag that not every torch has: where this one lacks it (see ``capability``),
    it reads ``False`` (``bool()``: an older torch behaves as if it were off: it
    never fills memory, oneDNN has no switch of its own), is never written, and
    a block leaves it ``False`` too."""
    get, put = capability.value or (bool, None)
    return _Flag(field, get, put, inside if put is not None else False)


#: The boolean flags, in :class:`FlagState`'s order (its first fields): each
#: one's whole story is its row.
_FLAGS = (
    # torch.backends.cudnn.deterministic: on in a block.
    _Flag("cudnn_deterministic", get_cudnn_deterministic, set_cudnn_deterministic, True),
    # torch.backends.cudnn.benchmark: off in a block (autotuning picks kernels by timing them).
    _Flag("cudnn_benchmark", get_cudnn_benchmark, set_cudnn_benchmark, False),
    # torch.use_deterministic_algorithms(mode): on in a block.
    _Flag("deterministic_algorithms", get_deterministic_algorithms, None, True),
    # torch.use_deterministic_algorithms(..., warn_only=): the block's ``warn_only``.
    _Flag("deterministic_warn_only", get_deterministic_algorithms_warn_only, None, "warn_only"),
    # torch.utils.deterministic.fill_uninitialized_memory: the block's own (default on).
    _optional_flag(
        "fill_uninitialized_memory",
        _torch.FILL_UNINITIALIZED_MEMORY,
        "fill_uninitialized_memory",
    ),
    # torch.backends.mkldnn.deterministic: on in a block.
    _optional_flag("mkldnn_deterministic", _torch.MKLDNN_DETERMINISTIC, True),
)
_BOOLS = tuple(flag.field for flag in _FLAGS)

#: The flags this torch lacks: held ``False`` in every state, never written.
UNSUPPORTED_FLAGS: frozenset[str] = frozenset(flag.field for flag in _FLAGS if flag.get is bool)
assert FlagState._fields[: len(_BOOLS)] == _BOOLS
assert len(FlagState._fields) == len(_BOOLS) + 7
#: Where :data:`~.precision.Precision` lies in :class:`FlagState`.
_PRECISION_FIRST: Final = 7
_PRECISION_END: Final = 12
assert FlagState._fields[_PRECISION_FIRST] == "float32_matmul_precision"
assert FlagState._fields[_PRECISION_END - 1] == "onednn_allow_tf32"
_GETTERS = tuple(flag.get for flag in _FLAGS)
_MODE = _BOOLS.index("deterministic_algorithms")
_WARN_ONLY = _BOOLS.index("deterministic_warn_only")
#: The flags each written by a setter of its own (all but the mode and warn_only,
#: and the flags this torch lacks), as ``(position, setter)``.
_SINGLES = tuple((i, flag.set) for i, flag in enumerate(_FLAGS) if flag.set is not None)
#: ``_call(f)`` is ``f()`` (``operator.call``, Python 3.11+).
_call: Callable[[Callable[[], bool]], bool] = getattr(operator, "call", lambda f: f())
#: Each flag's value inside a block, by the block's ``(warn_only, fill_uninitialized_memory)``.
_INSIDE = {
    (w, f): tuple(
        flag.inside
        if type(flag.inside) is bool
        else {"warn_only": w, "fill_uninitialized_memory": f}[flag.inside]
        for flag in _FLAGS
    )
    for w in (False, True)
    for f in (False, True)
}


def _write_flags(want: tuple[Any, ...], now: tuple[Any, ...] | None) -> None:
    """Write each flag whose value in ``want`` differs from ``now`` (just read;
    ``None``: write every one).

    The mode and warn_only are written together, by the one call that sets
    both (each of their setters writes the other too)."""
    for i, setter in _SINGLES:
        if now is None or now[i] != want[i]:
            setter(want[i])
    if now is None or now[_MODE] != want[_MODE] or now[_WARN_ONLY] != want[_WARN_ONLY]:
        set_deterministic_algorithms(want[_MODE], warn_only=want[_WARN_ONLY])


# -- one op's call without the alert (core/exempt.py) ----------------------------


def read_alerts() -> tuple[bool, bool]:
    """``(mode, warn_only)`` of ``use_deterministic_algorithms`` now."""
    return get_deterministic_algorithms(), get_deterministic_algorithms_warn_only()


def write_alerts(state: tuple[bool, bool]) -> None:
    """Write ``(mode, warn_only)``: the exemption turns the mode off with
    ``warn_only`` unchanged, and writes back what :func:`read_alerts` read
    (idempotent, so a completion step can write it again)."""
    set_deterministic_algorithms(state[0], warn_only=state[1])


# -- the source ----------------------------------------------------------------


class TorchFlagsSource(SettingSource):
    """Algorithm-selection flags of torch, cuDNN, oneDNN and inductor, and the
    TF32/precision flags, restored exactly."""

    name = "torch.flags"

    def capture(self) -> FlagState:
        inductor: bool | None = None
        override: object = AT_DEFAULT
        if _INDUCTOR in sys.modules:
            value, override = _ENTRY.read()
            inductor = None if value is None else bool(value)
        values: list[object] = list(map(_call, _GETTERS))  # called from C, no frame each
        values += (inductor, *capture_precision(), override)
        # FlagState._make without its Python frame and length check: the flags'
        # fields, then these seven (asserted below the table).
        return tuple.__new__(FlagState, values)

    def apply(self, settings: Settings) -> None:
        if not settings.flags:  # the caller's flags, captured and restored all the same
            return
        want = _INSIDE[settings.warn_only, settings.fill_uninitialized_memory]
        now = tuple(map(_call, _GETTERS))  # C-level calls, no Python frame each
        if now != want:
            _write_flags(want, now)
        # inductor's flag, unless set already (nested blocks)
        if _INDUCTOR in sys.modules and _ENTRY.read()[1] is not True:
            _ENTRY.set(True)

    def restore(self, state: FlagState) -> None:
        if _INDUCTOR in sys.modules:
            _ENTRY.restore(state.inductor_override)
        # Every flag written, none read: each setter only stores its value, so
        # writing an unchanged one changes nothing, and five C calls cost less
        # than six reads and the writes they find needed (a swap of a
        # decorated generator's world writes most of them anyway).
        _write_flags(state, None)
        restore_precision(state[_PRECISION_FIRST:_PRECISION_END])

    def export_state(self, state: FlagState) -> dict[str, Any]:
        """The state as plain data: one entry per field, the precision fields as
        :func:`~.precision.export_precision` saves them, ``inductor_deterministic``
        only if someone set it (and only a bool can be saved).
        """
        out: dict[str, Any] = {f: getattr(state, f) for f in _BOOLS}
        if state.inductor_override != AT_DEFAULT:
            if type(state.inductor_override) is not bool:
                raise ValueError(
                    f"{_INDUCTOR}.deterministic holds {state.inductor_override!r}, not True or "
                    f"False, so these flags cannot be saved"
                )
            out["inductor_deterministic"] = state.inductor_override
        out.update(export_precision(state[_PRECISION_FIRST:_PRECISION_END]))
        return out

    def import_state(self, data: object, path: str) -> FlagState:
        """Check saved data and rebuild a state; ``ValueError`` names the bad field
        (see :func:`~.precision.import_precision` for the precision fields)."""
        d = _plain.fields(
            data,
            path,
            [*_BOOLS, "float32_matmul_precision", "fp32_precision"],
            ["inductor_deterministic", *OPTIONAL_PRECISION],
        )
        precision = import_precision(d, path)
        inductor = (
            _plain.flag(d["inductor_deterministic"], f"{path}.inductor_deterministic")
            if "inductor_deterministic" in d
            else None
        )
        flags = [_plain.flag(d[f], f"{path}.{f}") for f in _BOOLS]  # FlagState's first fields
        override = AT_DEFAULT if inductor is None else inductor
        return FlagState._make((*flags, inductor, *precision, override))
