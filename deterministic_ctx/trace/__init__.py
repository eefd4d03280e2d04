"""Traces: a run's fingerprints and environment, recorded on one machine and compared on another.

:func:`locate_divergence <deterministic_ctx.locate.locate_divergence>` compares
two runs in one process.  When the same seed gives other results on another
machine, GPU model or torch version, the two runs never meet: record a trace
on each machine with :func:`record_trace` (or ``deterministic-ctx trace record``
for an unmodified script), bring the files together, and
:func:`compare_traces` names the first module call that differs and the facts
of the two environments that differ, most likely culprits first.

A trace holds, in call order, the fingerprints of every module call's outputs
(and, with ``backward=True``, of the gradients), of the return value's leaves
and of the final parameters and buffers, as :func:`~deterministic_ctx.record.record_run`
records them for ``locate_divergence``; with ``ops=True`` also every aten op
call of the run (:class:`~deterministic_ctx.ops.OpRecorder`: the op, the
user's ``file:line``, the fingerprints of its outputs and of the inputs it got
from outside the recorded ops), so that a comparison names the first op whose
result differs, before the module output it feeds; and the environment that
decides results, read inside the block right after ``fn`` returned (so the flags and
thread count are those ``fn`` ran with): Python, torch, NumPy and CUDA/cuDNN
versions, the platform, CPU model, vector instruction set and BLAS, the
thread counts, CUDA device names, compute capabilities and SM counts, the
TF32 and matmul precision settings, the determinism flags and the managed
environment variables (most of them from :func:`~deterministic_ctx.reporting.report`).

CUDA is never initialized for a trace: device facts are recorded only when
``fn`` (or the script) initialized CUDA itself.  Where it did not, nothing it
computed ran on a GPU, so no device fact can explain its results.

A trace keeps a 16-byte BLAKE2b digest of each fingerprint rather than the
fingerprint itself: 16 bytes per tensor whatever its size.  Two tensors of one
shape and dtype have equal digests exactly when their fingerprints are equal
(but for a 128-bit hash collision).  Neither tells *where* two tensors differ:
a trace has no values, so a divergence names the module call and the tensor,
never the index or the size of the difference.

**File**: the container of :mod:`~deterministic_ctx.checkpoint` (sizes checked
against the file's length, a SHA-256 checksum, JSON, nothing ever unpickled)
with the signature ``b"\\x89DCT\\r\\n\\x1a\\n"`` and this state, version 1::

    {"format": "deterministic_ctx.trace", "version": 1,
     "source": "function train_step", "recorded": "2025-01-31T12:00:00+00:00",
     "status": null,            # a script's exit status; null for a function
     "seed": 0, "backward": false,
     "ops": false,              # optional: whether per-op events were recorded
     "environment": {"versions.torch": "2.13.0+cpu", "process.num_threads": 8, ...},
     "modules": [[root class, qualified name, class name], ...],
     "calls": [[module, start], ...],   # per module call: its index in modules, and
                                        # how many events had been recorded when it started
     "events": [[key, phase, what, module or null, call or null,
                 [[path, dtype, digest or null, *shape], ...]], ...],
     "digests": uint8 tensor, 16 bytes per distinct fingerprint}

``phase`` is ``"forward"``, ``"backward"``, ``"result"`` (a leaf of the return
value), ``"final"`` or ``"op"`` (an aten op call, only when ``"ops"`` is true:
``what`` is the op and the user's line, ``"aten.addmm.default at train.py:42
(in step)"``, a path under the working directory relative to it; module and
call are those of the innermost module call it ran in, or null; the key is
``["op", k, n]``, the ``n``-th op call after ``k`` module calls had started;
the leaves are the inputs from outside the recorded ops, ``"input 'weight'"``,
then the outputs and the arguments changed in place).  A
newer version, an unknown field, a wrong type, an index out of range or a
file over the checkpoint size limit raises :class:`InvalidTraceError`, an
:class:`~deterministic_ctx.InvalidSnapshotError`.

Example:
    >>> import torch
    >>> from deterministic_ctx.trace import compare_traces, record_trace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> a = record_trace(model, torch.ones(2, 4))
    >>> b = record_trace(model, torch.ones(2, 4))
    >>> a.calls, compare_traces(a, b).agree
    (3, True)
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib
import os
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..compare import short_repr, tensor_leaves
from ..context import deterministic
from ..fingerprint import fingerprint
from ..locate import Divergence
from ..ops import OpCall, TensorPrint, first_op_difference
from ..record import Event, OpWindow, Run, record_run
from ..rerun import SavedState, call_and_consume, check_fn, objects_to_reset
from ..timeline import Finding, compare_runs
from .culprits import EnvironmentDifference, environment_differences
from .facts import Fact, environment
from .fileformat import (
    DIGEST,
    FORMAT,
    NO_MODULE,
    TRACE_FILE,
    VERSION,
    InvalidTraceError,
    Trace,
    checked_path,
)

__all__ = [
    "FORMAT",
    "TRACE_FILE",
    "VERSION",
    "EnvironmentDifference",
    "InvalidTraceError",
    "Trace",
    "TraceComparison",
    "compare_traces",
    "environment",
    "record_in",
    "record_trace",
    "script_result",
]

# --- recording ------------------------------------------------------------------------------------


def record_trace(
    fn: Callable[..., Any],
    /,
    *args: Any,
    path: str | os.PathLike[str] | None = None,
    seed: int = 0,
    backward: bool = False,
    ops: bool = False,
    warn_only: bool = False,
    reset: Iterable[Any] = (),
    **kwargs: Any,
) -> Trace:
    """Run ``fn(*args, **kwargs)`` once in a fresh block and record its trace.

    The run is what one run of :func:`~deterministic_ctx.locate.locate_divergence`
    is: a fresh ``deterministic(seed, warn_only=warn_only)`` block with global
    module hooks that fingerprint every module call's outputs in call order
    (with ``backward=True`` also the gradients), then the return value's
    leaves and the final parameters and buffers of every model seen.  With
    ``ops=True`` every aten op call ``fn`` makes (its backward passes'
    included) is recorded too, in the timeline, with the user's ``file:line``
    and the fingerprints of its outputs and outside inputs
    (:class:`~deterministic_ctx.ops.OpRecorder`; on a CPU about 0.2 ms and
    150 bytes of file per op call, and the first recording of a process
    imports ``torch._dynamo``, about 2 s).  The environment is read inside
    the block right after ``fn`` returns (see the module docstring).
    Modules and optimizers passed as ``fn`` or as direct arguments, and the
    objects in ``reset``, are put back to their state before the run
    afterwards, as :func:`~deterministic_ctx.verify.assert_reproducible` does.

    With ``path`` the trace is also written there (atomically); either way it
    is returned.  Compare two with :func:`compare_traces`.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> trace = record_trace(model, torch.ones(2, 4), seed=3)
        >>> trace.seed, trace.calls, trace.source
        (3, 3, 'module Sequential')
        >>> with_ops = record_trace(model, torch.ones(2, 4), ops=True)
        >>> with_ops.ops, [e.what.split()[0] for e in with_ops.events if e.phase == "op"][:3]
        (True, ['aten.t.default', 'aten.addmm.default', 'aten.relu.default'])
    """
    block = deterministic(seed, warn_only=warn_only)
    _check_flag(ops, "ops")  # before the run, like the path
    if path is not None:
        path = checked_path(path, "path")
        _check_directory(path)
    trace = record_in(block, fn, args, kwargs, backward=backward, ops=ops, reset=reset)
    if path is not None:
        trace.save(path)
    return trace


def record_in(
    block: deterministic,
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    backward: bool = False,
    ops: bool = False,
    reset: Iterable[Any] = (),
    source: str | None = None,
    root: str = "result",
) -> Trace:
    """:func:`record_trace` with a block of any settings (the command line's ``trace record``).

    ``source`` describes what ran (default: ``fn``'s name); ``root`` names the
    return value in the leaves' paths (``result["loss"]``; a script's is
    ``globals``).

    Example:
        >>> import torch
        >>> from deterministic_ctx import deterministic
        >>> trace = record_in(deterministic(0, flags=False), torch.nn.Tanh(), (torch.ones(3),))
        >>> trace.environment["flags.deterministic_algorithms"]
        False
    """
    check_fn(fn)
    _check_flag(backward, "backward")
    _check_flag(ops, "ops")
    kwargs = dict(kwargs or {})
    objects = objects_to_reset(fn, args, kwargs, reset)
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]
    saved = SavedState(objects)
    facts: dict[str, Fact] = {}

    def observed(*a: Any, **k: Any) -> Any:
        result = call_and_consume(fn, a, k)
        facts.update(environment())  # inside the block, as fn left it
        return result

    # The whole call of fn (a backward pass in it included), not the final state.
    window = OpWindow() if ops else None
    if ops:
        # The first op recording of a process imports dynamo, which loads inductor's
        # config: imported before the block, the block sets inductor's determinism flag
        # in the first trace of a process as in the next ones (an environment fact).
        importlib.import_module("torch._dynamo")
    try:
        run = record_run(block, observed, args, kwargs, roots, backward=backward, ops=window)
    finally:
        saved.load()
    return _trace_of(
        run,
        source=_describe(fn) if source is None else source,
        seed=block.seed,
        backward=backward,
        environment=facts,
        root=root,
    )


def script_result(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """What a trace of a script records as its return value: the script's global variables
    that hold tensors or NumPy arrays (directly or in lists, tuples and dicts).

    Names starting with ``_`` are left out, and so are numbers and strings: a
    script's globals hold timestamps and paths that differ from run to run.

    Example:
        >>> import torch
        >>> sorted(script_result({"loss": torch.ones(1), "start": 3.5, "_x": torch.ones(1)}))
        ['loss']
    """
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_") and _holds_arrays(value)
    }


def _holds_arrays(value: object) -> bool:
    if isinstance(value, np.ndarray):
        return True
    if isinstance(value, torch.nn.Module):
        return False  # its parameters are fingerprinted as the final state
    if isinstance(value, Mapping):
        return any(_holds_arrays(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_arrays(v) for v in value)
    return any(True for _ in tensor_leaves(value, ""))


def _check_flag(value: object, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {short_repr(value)}")


def _describe(fn: object) -> str:
    if isinstance(fn, torch.nn.Module):
        return f"module {type(fn).__qualname__}"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"function {module}.{name}" if module not in (None, "__main__") else f"function {name}"


def _trace_of(
    run: Run,
    *,
    source: str,
    seed: int,
    backward: bool,
    environment: dict[str, Fact],
    root: str,
) -> Trace:
    """The trace of a recorded run: digests for its fingerprints, its op calls (if it
    recorded them) as ``"op"`` events in the timeline, and its return value's leaves as
    ``"result"`` events before the final state."""
    table: dict[bytes, int] = {}

    def slot(digest: bytes | None) -> tuple[int, int, int] | None:
        if digest is None:
            return None
        index = table.setdefault(digest, len(table))
        return (0, DIGEST * index, DIGEST * (index + 1))

    by_slot: dict[tuple[int, int, int], bytes] = {}
    data = run.data
    events: list[Event] = []
    for e in run.events:
        slots: list[tuple[int, int, int] | None] = []
        for s in e.slots:
            if s is None:
                slots.append(None)
                continue
            digest = by_slot.get(s)
            if digest is None:
                digest = by_slot[s] = _digest(data[s[0]][s[1] : s[2]])
            slots.append(slot(digest))
        events.append(dataclasses.replace(e, slots=tuple(slots)))
    starts = list(run.starts)
    if run.ops is not None:
        events, starts = _with_op_events(run, events, slot)
    results = []
    for path, leaf in _leaves(run.result, root, set()):
        shape, dtype, digest = _leaf_digest(leaf)
        results.append(
            Event(
                ("result", path),
                "result",
                path,
                paths=(path,),
                shapes=(shape,),
                dtypes=(dtype,),
                slots=(slot(digest),),
            )
        )
    first_final = next((i for i, e in enumerate(events) if e.phase == "final"), len(events))
    events[first_final:first_final] = results
    return Trace(
        source=source,
        recorded=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seed=seed,
        backward=backward,
        environment=environment,
        structure=tuple(run.structure),
        starts=tuple(starts),
        events=tuple(events),
        digests=b"".join(table),
        ops=run.ops is not None,
    )


def _with_op_events(
    run: Run, events: list[Event], slot: Callable[[bytes | None], tuple[int, int, int] | None]
) -> tuple[list[Event], list[int]]:
    """``events`` (the run's, with digest slots) with the run's op calls among them, and
    where each module call starts in that timeline.

    An op call goes before the first event recorded after it ran, so before the
    output of the module call it ran in.  The run says how many op calls had been
    recorded at each event and at each module call's start: walking both, the module
    calls running at each op call are known (the innermost is the op's module).
    """
    at_events = run.ops_at_events or []
    at_calls = run.ops_at_calls or []
    starts = run.starts
    merged: list[Event] = []
    running: list[int] = []  # module calls that started and did not end, innermost last
    started = placed = 0
    numbers: dict[int, int] = {}  # after k module calls started: op calls so far
    for i, call in enumerate(run.ops or ()):
        while True:
            start = started < len(at_calls) and at_calls[started] <= i
            event = placed < len(events) and at_events[placed] <= i
            if start and (not event or starts[started] <= placed):
                running.append(started)
                started += 1
            elif event:
                e = events[placed]
                if e.phase == "forward" and e.call_index in running:  # the call ended
                    del running[running.index(e.call_index) :]
                merged.append(e)
                placed += 1
            else:
                break
        n = numbers.get(started, 0)
        numbers[started] = n + 1
        inside = running[-1] if running else None
        merged.append(_op_event(call, ("op", started, n), inside, run.structure, slot))
    merged += events[placed:]
    # Op calls made before a module call started are exactly the first at_calls[c].
    return merged, [s + k for s, k in zip(starts, at_calls, strict=True)]


def _op_event(
    call: OpCall,
    key: tuple[Any, ...],
    inside: int | None,
    structure: list[tuple[str, str, str]],
    slot: Callable[[bytes | None], tuple[int, int, int] | None],
) -> Event:
    """The event of one op call: its inputs from outside the recorded ops, then its
    outputs (the order :func:`~deterministic_ctx.ops.first_op_difference` checks)."""
    prints = (*call.inputs, *call.outputs)
    label: tuple[str | None, str | None, str | None] = (
        NO_MODULE if inside is None else structure[inside]
    )
    where = dataclasses.replace(call, location=_relative(call.location))
    return Event(
        key,
        "op",
        where.described(),
        *label,
        inside,
        tuple([p.path for p in prints]),
        tuple([p.shape for p in prints]),
        tuple([p.dtype for p in prints]),
        tuple([slot(None if p.fingerprint is None else _digest(p.fingerprint)) for p in prints]),
    )


def _relative(location: str | None) -> str | None:
    """``file:line`` with a file under the working directory relative to it: the same
    script in two checkouts has the same name in both traces."""
    if location is None:
        return None
    file, colon, line = location.rpartition(":")
    return f"{_relative_file(file, os.getcwd())}:{line}" if colon else location


@functools.lru_cache(maxsize=1024)  # per file: a run makes many op calls in few files
def _relative_file(file: str, directory: str) -> str:
    if not os.path.isabs(file):
        return file
    try:
        relative = os.path.relpath(file, directory)
    except ValueError:  # another drive (Windows)
        return file
    return file if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST).digest()


def _key_path(key: object) -> str:
    # As compare.first_difference names paths: result["loss"], result[0].
    if isinstance(key, str):
        return '["' + key.replace("\\", "\\\\").replace('"', '\\"') + '"]'
    return f"[{key!r}]"


def _leaves(value: object, path: str, seen: set[int]) -> Iterator[tuple[str, object]]:
    """The leaves of a return value with their paths, recursing into mappings, lists,
    tuples (named tuples by field) and dataclasses, as :mod:`.compare` does."""
    children = _children(value)
    if children is None:
        yield path, value
        return
    if id(value) in seen:  # a cycle: already on the way here
        return
    seen.add(id(value))
    for suffix, child in children:
        yield from _leaves(child, path + suffix, seen)
    seen.discard(id(value))


def _children(value: object) -> list[tuple[str, object]] | None:
    """``(path suffix, child)`` of a container; ``None`` for a leaf."""
    if isinstance(value, Mapping):
        return [(_key_path(k), v) for k, v in value.items()]
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        fields: tuple[str, ...] = type(value)._fields  # type: ignore[attr-defined]
        return [(f".{name}", getattr(value, name)) for name in fields]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [
            (f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value) if f.compare
        ]
    return None


def _leaf_digest(leaf: object) -> tuple[tuple[int, ...], str, bytes | None]:
    """Shape, dtype (a type name for Python values) and digest of one leaf; ``None``
    for a leaf compared by type only (an object of another kind)."""
    if isinstance(leaf, torch.Tensor):
        found = fingerprint(leaf)
        data = None if found is None else found.detach().cpu().numpy().tobytes()
        dtype = str(leaf.dtype).removeprefix("torch.")
        return tuple(leaf.shape), dtype, None if data is None else _digest(data)
    if isinstance(leaf, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(leaf)
        if array.dtype.hasobject:
            return tuple(array.shape), str(array.dtype), None
        return tuple(array.shape), str(array.dtype), _digest(array.tobytes())
    raw: bytes | None
    if isinstance(leaf, bool) or leaf is None:
        raw = repr(leaf).encode()
    elif isinstance(leaf, int):
        raw = str(leaf).encode()
    elif isinstance(leaf, float):
        raw = struct.pack("<d", leaf)  # by its bits, as compare does: -0.0 is not 0.0
    elif isinstance(leaf, complex):
        raw = struct.pack("<dd", leaf.real, leaf.imag)
    elif isinstance(leaf, str):
        raw = leaf.encode("utf-8", "surrogatepass")
    elif isinstance(leaf, bytes):
        raw = leaf
    else:
        raw = None
    return (), type(leaf).__qualname__, None if raw is None else _digest(raw)


# --- comparing ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceComparison:
    """What :func:`compare_traces` found.

    ``agree`` is true when every fingerprint of the two traces matched (module
    outputs, gradients, the return value, final parameters and buffers);
    otherwise ``divergence`` is the first difference in A's call order, named
    as :class:`~deterministic_ctx.locate.Divergence` names it for
    ``locate_divergence`` (``run`` is 2: trace B; ``index`` and
    ``max_abs_diff`` are ``None``, a trace has no values).  ``environment``
    lists the facts that differ, most likely culprits first: the seed, then
    torch/CUDA/cuDNN versions, the GPU (model, capability, SM count), thread
    counts, TF32 and matmul precision, determinism flags and variables, the
    CPU (model, instruction set, BLAS), then the rest; in each kind, in A's
    order.  ``a`` / ``b`` describe the traces, ``calls`` their numbers of
    module calls, ``compared`` the fingerprinted events that agreed (before
    the divergence, or in all), ``notes`` what was left out of the comparison,
    ``ops`` whether op calls were compared (both traces recorded them).  Then
    the first difference may be an op call's (``divergence.phase`` is
    ``"op"``): ``divergence.op`` and ``divergence.op_location`` name it and
    the user's ``file:line`` as ``locate_divergence(..., ops=True)`` does,
    ``op_detail`` says which of its tensors differs and what that means
    (``kind`` is ``"call"`` when the traces called different ops there), and
    ``module`` / ``call_index`` are the innermost module call it ran in
    (``None`` outside any).  ``str()`` is for people, ``to_dict()`` for tools.
    """

    a: str
    b: str
    calls: tuple[int, int]
    compared: int
    divergence: Divergence | None
    environment: tuple[EnvironmentDifference, ...]
    notes: tuple[str, ...] = ()
    ops: bool = False

    @property
    def agree(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ints, strings, lists, dicts, bools, floats and ``None`` only.

        Example:
            >>> import json, torch
            >>> t = record_trace(torch.nn.Linear(2, 2), torch.ones(1, 2))
            >>> json.loads(json.dumps(compare_traces(t, t).to_dict()))["agree"]
            True
        """
        out: dict[str, Any] = {
            "agree": self.agree,
            "a": self.a,
            "b": self.b,
            "calls": list(self.calls),
            "compared": self.compared,
            "divergence": None,
            "environment": [dataclasses.asdict(d) for d in self.environment],
            "notes": list(self.notes),
            "ops": self.ops,
        }
        d = self.divergence
        if d is not None:
            div = dataclasses.asdict(d)
            div["shapes"] = [list(s) for s in d.shapes]
            div["other_shapes"] = [list(s) for s in d.other_shapes]
            div["index"] = None
            div["location"] = d.location
            out["divergence"] = div
        return out

    def __str__(self) -> str:
        d = self.divergence
        if d is None:
            ops = "op calls, " if self.ops else ""
            lines = [
                f"Traces agree: {self.calls[0]} module calls; all {self.compared} fingerprints "
                f"({ops}module outputs and gradients, the return value, the final parameters "
                "and buffers) are identical."
            ]
        else:
            lines = [f"Traces diverge: B differs from A first at {_where(d)}"]
        lines += [f"  A: {self.a}", f"  B: {self.b}"]
        if d is not None:
            if d.root is not None and d.module is not None:
                lines.append(f"  in model {d.root}; module call order counts from 0")
            if d.shapes:
                lines.append(f"  shapes: {', '.join(map(str, d.shapes))}")
            lines.append(f"  {d.detail}")
            if d.op_detail is not None:
                lines.append(f"  first differing op: {d.op_detail}")
            lines.append(f"  {self.compared} earlier fingerprint(s) agree")
        lines += [f"  note: {note}" for note in self.notes]
        if not self.environment:
            lines.append("Environment: the recorded facts are identical")
            return "\n".join(lines)
        count = len(self.environment)
        anyway = " (the results agree all the same)" if d is None else ""
        lines.append(f"Environment: {count} fact(s) differ{anyway}, most likely culprits first:")
        category = None
        for diff in self.environment:
            if diff.category != category and diff.why:
                lines.append(f"  [{diff.category}] {diff.why}")
            category = diff.category
            lines.append(f"    {diff}")
        return "\n".join(lines)


def _where(d: Divergence) -> str:
    """Where a divergence is, as :class:`~deterministic_ctx.locate.DivergenceReport` says it."""
    if d.phase == "forward":
        where = f"module call #{d.call_index}, {d.location}"
        return where if d.kind in ("call", "missing", "extra") else f"{where}, forward {d.what}"
    if d.phase == "backward":
        return f"{d.location} (call #{d.call_index}), backward: {d.what}"
    if d.phase == "final":
        return f"{d.location}: {d.what}"
    if d.phase == "op":
        op = d.what if d.op is None else d.op
        if d.op_location is not None:
            op += f" at {d.op_location}"
        if d.module is None:
            return f"{op}, outside any module call"
        return f"{op} in module call #{d.call_index}, {d.location}"
    return f"the return value at {d.what}"


def compare_traces(
    a: Trace | str | os.PathLike[str], b: Trace | str | os.PathLike[str]
) -> TraceComparison:
    """Compare two traces (objects or files): the first module call whose fingerprints
    differ, and the environment facts that differ.

    The timeline is compared as ``locate_divergence`` compares two runs (A is
    its run 1, B its run 2): module calls in A's order, a module called in one
    trace and not the other, shapes and dtypes, then fingerprints, then the
    final parameters and buffers.  When both traces recorded op calls
    (``ops=True``), they are in the timeline too, each before the output of
    the module call it ran in: the first op call whose fingerprints, shapes
    or dtypes differ is named before the module output it feeds, as
    ``divergence.op`` and ``divergence.op_location``.  Op calls are matched
    by position (the ``n``-th after the same module call started; another op
    there with the same results is not a difference), so traces whose op
    sequences differ (another torch version that decomposes an op otherwise,
    say) diverge where their results part (``kind`` ``"call"``).  Traces
    recorded with and without ``backward`` or ``ops`` are compared without
    the gradients or op calls (a note says so).  Files are read with
    :meth:`Trace.load`: bad input raises :class:`InvalidTraceError`.

    Example:
        >>> import torch
        >>> def step(scale):
        ...     model = torch.nn.Linear(4, 2)
        ...     return model(torch.ones(1, 4)) * scale
        >>> report = compare_traces(record_trace(step, 1.0), record_trace(step, 2.0))
        >>> report.agree, report.divergence.phase, report.divergence.what
        (False, 'result', 'result')
    """
    name_a, trace_a = _trace_arg(a, "a", "A")
    name_b, trace_b = _trace_arg(b, "b", "B")
    notes: list[str] = []
    drop_a: set[str] = set()
    drop_b: set[str] = set()
    for phase, flag, what in (("backward", "backward", "gradients"), ("op", "ops", "op events")):
        in_a, in_b = getattr(trace_a, flag), getattr(trace_b, flag)
        if in_a != in_b:
            (drop_a if in_a else drop_b).add(phase)
            notes.append(
                f"only {'A' if in_a else 'B'} recorded {what} ({flag}=True): compared without them"
            )
    if trace_a.status != trace_b.status:
        notes.append(
            f"the scripts exited with status {trace_a.status} (A) and {trace_b.status} (B)"
        )
    run_a, run_b = _as_run(trace_a, drop_a), _as_run(trace_b, drop_b)
    unfilled = False in (trace_a.environment.get(_FILL), trace_b.environment.get(_FILL))
    finding, agreed = compare_runs(run_a, run_b, run=2)
    return TraceComparison(
        a=name_a,
        b=name_b,
        calls=(trace_a.calls, trace_b.calls),
        compared=agreed,
        divergence=None if finding is None else _divergence(finding, run_a, run_b, unfilled),
        environment=environment_differences(trace_a, trace_b),
        notes=tuple(notes),
        ops=trace_a.ops and trace_b.ops,
    )


def _trace_arg(value: object, name: str, side: str) -> tuple[str, Trace]:
    """A trace argument of :func:`compare_traces` (a trace or a path), and how the report
    names it."""
    if isinstance(value, Trace):
        trace, where = value, f"trace {side}"
    elif isinstance(value, (str, os.PathLike)):
        trace, where = Trace.load(value), os.fspath(value)
    else:
        raise TypeError(
            f"{name} must be a Trace or the path of a trace file, got "
            f"{type(value).__qualname__} {short_repr(value)}"
        )
    status = "" if trace.status is None else f", exit status {trace.status}"
    return f"{where} ({trace.source}, seed {trace.seed}{status}, recorded {trace.recorded})", trace


def _as_run(trace: Trace, drop: set[str]) -> Run:
    """The trace as a recorded run for :func:`~deterministic_ctx.timeline.compare_runs`,
    without the events of the phases in ``drop``."""
    events: list[Event] = list(trace.events)
    starts = list(trace.starts)
    if drop:
        kept: list[Event] = []
        before = [0]  # before[i]: events kept among the first i
        for e in events:
            if e.phase not in drop:
                kept.append(e)
            before.append(len(kept))
        events, starts = kept, [before[s] for s in starts]
    # Slots point into one buffer, the digests; the return value is in the events.
    return Run(events, [trace.digests], None, list(trace.structure), starts, None)


_RUN_NAMES = ((re.compile(r"\brun 1\b"), "A"), (re.compile(r"\brun 2\b"), "B"))


def _divergence(finding: Finding, a: Run, b: Run, unfilled: bool = False) -> Divergence:
    """The public description of ``finding``, trace B (``b``) against trace A (``a``);
    ``unfilled``: a trace was recorded without filling uninitialized memory."""
    e = finding.event
    what = e.what
    detail = finding.detail
    kind = finding.kind
    op: tuple[str | None, str | None, str | None] = (None, None, None)
    if e.phase == "op":
        kind, op = _op_divergence(finding, a, b)
        if unfilled and op[0] is not None and op[0].startswith(_UNINITIALIZED):
            op = (op[0], op[1], f"{op[2]}; {_UNFILLED}")
    if finding.kind == "values":
        if e.phase == "forward" and len(e.paths) > 1:
            what = e.paths[finding.leaf]  # which output of several
        detail = (
            f"the fingerprints of {e.paths[finding.leaf]} differ (a trace keeps fingerprints, "
            "not values: where and by how much is unknown)"
        )
    for pattern, side in _RUN_NAMES:  # the timeline's messages name runs 1 and 2
        detail = pattern.sub(side, detail)
    return Divergence(
        phase=e.phase,
        kind=kind,
        module=e.module,
        module_type=e.module_type,
        root=e.root,
        call_index=e.call_index,
        what=what,
        shapes=e.shapes,
        other_shapes=() if finding.other is None else finding.other.shapes,
        index=None,
        max_abs_diff=None,
        run=2,
        detail=detail,
        op=op[0],
        op_location=op[1],
        op_detail=op[2],
    )


#: The environment fact of torch.utils.deterministic.fill_uninitialized_memory.
_FILL = "flags.fill_uninitialized_memory"
#: Ops whose outputs hold whatever the memory held unless that flag is on.
_UNINITIALIZED = ("aten.empty", "aten.new_empty")
_UNFILLED = (
    "a trace was recorded with flags.fill_uninitialized_memory off, so this op's output "
    "holds whatever the memory held: record both with it on (the default of a deterministic "
    "block; the command line's --no-fill and --no-flags turn it off)"
)


def _op_divergence(
    finding: Finding, a: Run, b: Run
) -> tuple[str, tuple[str | None, str | None, str | None]]:
    """The kind of a difference found at an op event, and ``(op, op_location, op_detail)``
    as :func:`~deterministic_ctx.locate.locate_divergence` names them: the op calls of the
    two traces at that point, compared by :func:`~deterministic_ctx.ops.first_op_difference`
    (which tensor differs, and what that says)."""
    e, other = finding.event, finding.other
    if finding.kind == "extra":  # only B called it: the event is B's
        call = _op_call(e, b)
        where = f"B called {call.described()}, A made only {_since(e.key)}"
        return "extra", (call.op, call.location, where)
    call = _op_call(e, a)
    ops = [x for x in a.events if x.phase == "op"]
    count = f"op call #{next(i for i, x in enumerate(ops) if x is e)} of {len(ops)} in A"
    if other is None:
        where = f"{count}: A called {call.described()}, B made only {_since(e.key)}"
        return "missing", (call.op, call.location, where)
    diff = first_op_difference([call], [_op_call(other, b)], left="A", right="B")
    if diff is None:  # unreached: both compare the same fields; a report all the same
        return finding.kind, (call.op, call.location, f"{call.described()}, {count}")
    if diff.kind == "op":  # another op was called at this point
        return "call", (call.op, call.location, f"{count}: {diff.detail}")
    return finding.kind, (call.op, call.location, f"{call.described()}, {count}: {diff.detail}")


def _since(key: tuple[Any, ...]) -> str:
    """How many op calls the other trace made in the stretch of the op event ``key``."""
    started, number = key[1], key[2]
    if started == 0:
        return f"{number} op call(s) before its first module call"
    return f"{number} op call(s) since module call #{started - 1} started"


#: ``what`` of an op event: :meth:`~deterministic_ctx.ops.OpCall.described`'s format.
_OP_WHAT = re.compile(
    r"(?P<op>\S+)(?: at (?P<location>.+?:\d+)(?: \(in (?P<function>[^()]*)\))?)?"
    r"(?:, in the backward of (?P<node>\S+))?"
)


def _op_call(event: Event, run: Run) -> OpCall:
    """The op call an op event records, back from the event (the digests stand for the
    fingerprints)."""
    match = _OP_WHAT.fullmatch(event.what)
    parts: dict[str, str | None] = (
        match.groupdict() if match else {"op": event.what, "location": None}
    )
    prints = [
        TensorPrint(path, shape, dtype, digest)
        for path, shape, dtype, digest in zip(
            event.paths, event.shapes, event.dtypes, run.fingerprints(event), strict=True
        )
    ]
    inputs = tuple(p for p in prints if p.path.startswith("input "))
    return OpCall(
        0,
        parts["op"] or event.what,
        parts.get("location"),
        parts.get("function"),
        parts.get("node"),
        tuple(p for p in prints if not p.path.startswith("input ")),
        inputs,
    )


def _check_directory(path: str) -> None:
    """Fail before the run, not after it, when the trace could not be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"path: the directory {directory!r} of {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"path: {path!r} is a directory")
