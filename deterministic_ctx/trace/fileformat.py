"""The trace and its file: :class:`Trace`, writing and reading it, checking every field read.

The file is the container of :mod:`~deterministic_ctx.state.checkpoint` with the
signature of :data:`TRACE_FILE`, holding the state that the docstring of
:mod:`deterministic_ctx.trace` describes; bad input raises :class:`InvalidTraceError`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from .._errors import PUBLIC_MODULE
from ..base.plain import fields as plain_fields
from ..base.plain import flag as plain_flag
from ..base.plain import integer as plain_integer
from ..base.plain import mapping as plain_mapping
from ..base.plain import shown as plain_shown
from ..state.checkpoint import (
    FileKind,
    InvalidSnapshotError,
    decode,
    encode,
    origin_of,
    read,
    write,
)
from ..verify.compare import short_repr
from ..verify.record import Event
from .facts import Fact

FORMAT = "deterministic_ctx.trace"
VERSION = 1
#: Bytes per digest (BLAKE2b) of a fingerprint.
DIGEST = 16
_PHASES = ("forward", "backward", "result", "final", "op")
#: Longer strings, deeper shapes and longer keys are not made by a recording: refused.
_MAX_TEXT = 1 << 16
_MAX_DIMS = 64
_MAX_KEY = 16


class InvalidTraceError(InvalidSnapshotError):
    """A trace file (or its data) cannot be read: a snapshot-like error for traces.

    A subclass of :class:`~deterministic_ctx.InvalidSnapshotError` (so of
    ``ValueError``), raised for the same kinds of bad input as a corrupted
    snapshot: truncated or corrupted, another kind of file, a newer format
    version, a field of the wrong type or out of range.  ``origin`` names the
    file and ``problem`` says what is wrong.

    Example:
        >>> str(InvalidTraceError("file 'a.trace'", "truncated"))
        "invalid trace file 'a.trace': truncated"
    """

    __module__ = PUBLIC_MODULE

    def __init__(self, origin: str, problem: str) -> None:
        super().__init__(origin, problem)
        self.args = (f"invalid trace {origin}: {problem}",)


#: The container of a trace file (see :mod:`~deterministic_ctx.state.checkpoint`).
TRACE_FILE = FileKind("trace", b"\x89DCT\r\n\x1a\n", InvalidTraceError)


# --- the trace ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Trace:
    """One recorded run: fingerprints in call order and the environment.

    ``source`` says what ran (``"function train_step"``, ``"script train.py
    --epochs 2"``), ``recorded`` when (ISO 8601, UTC), ``status`` a script's
    exit status (``None`` for a function).  ``environment`` maps fact names
    (``"versions.torch"``, ``"process.num_threads"``, ``"cuda.devices[0].sm_count"``)
    to plain values.  ``structure`` is who was called, per module call:
    ``(root class, qualified name, class name)``; ``starts`` how many events
    had been recorded when each call started; ``events`` the events
    (:class:`~deterministic_ctx.verify.record.Event`) whose ``slots`` point into
    ``digests``.  ``ops`` says whether per-op events were recorded.  Made by
    :func:`record_trace`; :meth:`save` and :meth:`load` write and read files.

    Example:
        >>> import torch
        >>> from deterministic_ctx import record_trace
        >>> trace = record_trace(torch.nn.Linear(2, 2), torch.ones(1, 2))
        >>> [(e.phase, e.what) for e in trace.events][:2]
        [('forward', 'output'), ('result', 'result')]
        >>> trace.environment["process.num_threads"] == torch.get_num_threads()
        True
    """

    source: str
    recorded: str
    seed: int
    backward: bool
    environment: Mapping[str, Fact] = dataclasses.field(repr=False)
    structure: tuple[tuple[str, str, str], ...] = dataclasses.field(repr=False)
    starts: tuple[int, ...] = dataclasses.field(repr=False)
    events: tuple[Event, ...] = dataclasses.field(repr=False)
    digests: bytes = dataclasses.field(repr=False)
    status: int | None = None
    ops: bool = False

    @property
    def calls(self) -> int:
        """The number of module calls."""
        return len(self.structure)

    def fingerprints(self, event: Event) -> tuple[bytes | None, ...]:
        """The digests of ``event``'s tensors' fingerprints (``None``: none)."""
        data = self.digests
        return tuple([None if s is None else data[s[1] : s[2]] for s in event.slots])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to ``path`` atomically, in a format that never unpickles.

        Example:
            >>> import tempfile, torch
            >>> from deterministic_ctx import record_trace
            >>> trace = record_trace(torch.nn.Linear(2, 2), torch.ones(1, 2))
            >>> with tempfile.TemporaryDirectory() as tmp:
            ...     trace.save(f"{tmp}/run.trace")
            ...     Trace.load(f"{tmp}/run.trace") == trace
            True
        """
        path = checked_path(path, "path")
        write(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save`; nothing in the file is executed.

        Bad input raises :class:`InvalidTraceError` naming the file and the
        problem; a missing file ``FileNotFoundError``.  See :meth:`save`.
        """
        path = checked_path(path, "path")
        return cls.from_bytes(read(path, TRACE_FILE), origin_of(path))

    def to_bytes(self) -> bytes:
        """The file's bytes (what :meth:`save` writes).

        Example:
            >>> import torch
            >>> from deterministic_ctx import record_trace
            >>> trace = record_trace(torch.nn.Linear(2, 2), torch.ones(1, 2))
            >>> Trace.from_bytes(trace.to_bytes()) == trace
            True
        """
        return encode(_to_state(self), TRACE_FILE)

    @classmethod
    def from_bytes(cls, data: bytes, origin: str = "data") -> Trace:
        """The trace in ``data``; :class:`InvalidTraceError` naming ``origin`` if there is none."""
        state = decode(data, origin, TRACE_FILE)
        try:
            return _from_state(state)
        except ValueError as exc:
            raise InvalidTraceError(origin, str(exc)) from exc
        except Exception as exc:  # whatever a field made a check trip over is bad input too
            raise InvalidTraceError(origin, f"{type(exc).__name__}: {exc}") from exc


# --- the file's state -----------------------------------------------------------------------------


def checked_path(path: object, name: str) -> str:
    checked = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(checked, str):
        raise TypeError(
            f"{name} must be a str or os.PathLike, got {type(path).__qualname__} {short_repr(path)}"
        )
    return checked


def _to_state(trace: Trace) -> dict[str, Any]:
    modules: dict[tuple[str, str, str], int] = {}

    def module(label: tuple[str, str, str]) -> int:
        return modules.setdefault(label, len(modules))

    calls = [
        [module(label), start] for label, start in zip(trace.structure, trace.starts, strict=True)
    ]
    events = []
    for e in trace.events:
        label = None
        if e.root is not None and e.module is not None and e.module_type is not None:
            label = module((e.root, e.module, e.module_type))
        leaves = [
            [path, dtype, None if slot is None else slot[1] // DIGEST, *shape]
            for path, shape, dtype, slot in zip(e.paths, e.shapes, e.dtypes, e.slots, strict=True)
        ]
        events.append([list(e.key), e.phase, e.what, label, e.call_index, leaves])
    # frombuffer refuses an empty buffer; the device is explicit (the default may be another).
    digests = (
        torch.frombuffer(bytearray(trace.digests), dtype=torch.uint8)
        if trace.digests
        else torch.empty(0, dtype=torch.uint8, device="cpu")
    )
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": trace.source,
        "recorded": trace.recorded,
        "status": trace.status,
        "seed": trace.seed,
        "backward": trace.backward,
        "ops": trace.ops,
        "environment": dict(trace.environment),
        "modules": [list(label) for label in modules],
        "calls": calls,
        "events": events,
        "digests": digests,
    }


_REQUIRED = (
    "format",
    "version",
    "source",
    "recorded",
    "status",
    "seed",
    "backward",
    "environment",
    "modules",
    "calls",
    "events",
    "digests",
)


def _from_state(state: dict[str, Any]) -> Trace:
    """Check every field of a decoded trace; ``ValueError`` naming the first bad one."""
    top = plain_fields(state, "trace", _REQUIRED, ("ops",))
    _text(top["format"], "format")
    if top["format"] != FORMAT:
        raise ValueError(f"format: expected {FORMAT!r}, got {short_repr(top['format'])}")
    version = top["version"]
    if type(version) is int and version > VERSION:
        raise ValueError(
            f"version {version} is newer than this deterministic-ctx reads ({VERSION}): "
            "upgrade deterministic-ctx to read it"
        )
    plain_integer(version, "version", VERSION, VERSION)
    status = top["status"]
    if status is not None:
        plain_integer(status, "status", -(2**31), 2**31 - 1)
    ops = plain_flag(top.get("ops", False), "ops")
    digests = top["digests"]
    if (
        not (
            isinstance(digests, torch.Tensor)
            and digests.dtype == torch.uint8
            and digests.dim() == 1
        )
        or digests.numel() % DIGEST
    ):
        raise ValueError(f"digests: expected a uint8 tensor of {DIGEST} bytes per fingerprint")
    count = digests.numel() // DIGEST
    environment = {
        _text(name, "environment key"): _fact(value, f"environment[{name!r}]")
        for name, value in plain_mapping(top["environment"], "environment").items()
    }
    modules = []
    for i, label in enumerate(_list(top["modules"], "modules")):
        root, name, kind = _list(label, f"modules[{i}]", 3, 3)
        path = f"modules[{i}]"
        modules.append((_text(root, path), _text(name, path), _text(kind, path)))
    structure: list[tuple[str, str, str]] = []
    starts: list[int] = []
    raw_events = _list(top["events"], "events")
    for i, call in enumerate(_list(top["calls"], "calls")):
        index, start = _list(call, f"calls[{i}]", 2, 2)
        structure.append(modules[plain_integer(index, f"calls[{i}][0]", 0, len(modules) - 1)])
        low = starts[-1] if starts else 0
        starts.append(plain_integer(start, f"calls[{i}][1]", low, len(raw_events)))
    events = [
        _event(raw, f"events[{i}]", modules, len(structure), count, ops)
        for i, raw in enumerate(raw_events)
    ]
    return Trace(
        source=_text(top["source"], "source"),
        recorded=_text(top["recorded"], "recorded"),
        seed=plain_integer(top["seed"], "seed", 0, 2**64 - 1),
        backward=plain_flag(top["backward"], "backward"),
        environment=environment,
        structure=tuple(structure),
        starts=tuple(starts),
        events=tuple(events),
        digests=digests.numpy().tobytes(),
        status=status,
        ops=ops,
    )


def _event(
    raw: object,
    path: str,
    modules: list[tuple[str, str, str]],
    calls: int,
    digests: int,
    ops: bool,
) -> Event:
    """One event of the file.  A trace holds many: each check is a plain comparison first,
    and only a value that fails it goes to the reader that names the problem (and raises)."""
    if type(raw) is not list or len(raw) != 6:
        _list(raw, path, 6, 6)
    key, phase, what, module, call, leaves = cast("list[Any]", raw)
    if type(key) is not list or not 0 < len(key) <= _MAX_KEY:
        _list(key, f"{path}[0]", 1, _MAX_KEY)
    for j, item in enumerate(key):
        if type(item) is not int and (type(item) is not str or len(item) > _MAX_TEXT):
            _text(item, f"{path}[0][{j}]")
    if phase not in _PHASES or (phase == "op" and not ops):  # a str: _PHASES holds only str
        allowed = _PHASES if ops else _PHASES[:-1]
        got = plain_shown(phase) if type(phase) is not str else repr(phase[:60])
        raise ValueError(f"{path}[1]: expected one of {', '.join(allowed)}, got {got}")
    if type(what) is not str or len(what) > _MAX_TEXT:
        _text(what, f"{path}[2]")
    label: tuple[str | None, str | None, str | None] = NO_MODULE
    if module is not None:
        if type(module) is not int or not 0 <= module < len(modules):
            plain_integer(module, f"{path}[3]", 0, len(modules) - 1)
        label = modules[module]
    if call is not None and (type(call) is not int or not 0 <= call < calls):
        plain_integer(call, f"{path}[4]", 0, calls - 1)
    if type(leaves) is not list:
        _list(leaves, f"{path}[5]")
    paths, shapes, dtypes, slots = [], [], [], []
    for j, leaf in enumerate(leaves):
        if type(leaf) is not list or not 3 <= len(leaf) <= 3 + _MAX_DIMS:
            _list(leaf, f"{path}[5][{j}]", 3, 3 + _MAX_DIMS)
        name, dtype, digest, *dims = leaf
        if type(name) is not str or len(name) > _MAX_TEXT:
            _text(name, f"{path}[5][{j}][0]")
        if type(dtype) is not str or len(dtype) > _MAX_TEXT:
            _text(dtype, f"{path}[5][{j}][1]")
        if digest is not None and (type(digest) is not int or not 0 <= digest < digests):
            plain_integer(digest, f"{path}[5][{j}][2]", 0, digests - 1)
        for k, n in enumerate(dims):
            if type(n) is not int or not 0 <= n < 2**63:
                plain_integer(n, f"{path}[5][{j}][{3 + k}]", 0, 2**63 - 1)
        paths.append(name)
        shapes.append(tuple(dims))
        dtypes.append(dtype)
        slots.append(None if digest is None else (0, DIGEST * digest, DIGEST * (digest + 1)))
    return Event(
        tuple(key),
        phase,
        what,
        *label,
        call,
        tuple(paths),
        tuple(shapes),
        tuple(dtypes),
        tuple(slots),
    )


#: The module of an event that belongs to none (a leaf of the return value).
NO_MODULE: tuple[None, None, None] = (None, None, None)


# Checked reading of plain data: the snapshot sources' readers (through the internal API),
# and two they do not have: exact types only (a subclass could run code), a path in every message.


def _list(value: object, path: str, low: int = 0, high: int | None = None) -> list[Any]:
    if type(value) is not list or len(value) < low or (high is not None and len(value) > high):
        size = f"{low} .. {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{path}: expected a list of {size} items, got {plain_shown(value)}")
    return value


def _text(value: object, path: str) -> str:
    if type(value) is not str or len(value) > _MAX_TEXT:
        raise ValueError(
            f"{path}: expected a string of at most {_MAX_TEXT} characters, got {plain_shown(value)}"
        )
    return value


def _fact(value: object, path: str) -> Fact:
    if type(value) is str:
        return _text(value, path)
    if value is None or type(value) in (int, float, bool):
        return value  # type: ignore[return-value]  # checked just above
    raise ValueError(f"{path}: expected a string, number, bool or null, got {plain_shown(value)}")
