"""Recording a trace: one run of ``fn`` (or a script) in a deterministic block, kept as the
digests of what it computed, its op calls if asked, and the facts of the environment it ran in.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from .._torch.internals import import_dynamo
from ..core.context import deterministic
from ..verify.compare import float_bits, leaves
from ..verify.fingerprint import fingerprint_parts
from ..verify.record import Event, OpWindow, Run, record
from ..verify.rerun import call_and_consume, prepare_runs
from .facts import Fact, environment
from .fileformat import DIGEST, NO_MODULE, Trace, checked_path


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

    The run is what one run of :func:`~deterministic_ctx.verify.locate.locate_divergence`
    is: a fresh ``deterministic(seed, warn_only=warn_only)`` block with global
    module hooks that fingerprint every module call's outputs in call order
    (with ``backward=True`` also the gradients), then the return value's
    leaves and the final parameters and buffers of every model seen.  With
    ``ops=True`` every aten op call ``fn`` makes (its backward passes'
    included) is recorded too, in the timeline, with the user's ``file:line``
    and the fingerprints of its outputs and outside inputs
    (:class:`~deterministic_ctx.verify.ops.OpRecorder`; on a CPU about 0.2 ms and
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
    kwargs = dict(kwargs or {})
    objects, saved = prepare_runs(fn, args, kwargs, reset, backward=backward, ops=ops)
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]
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
        import_dynamo()
    try:
        run = record(block, observed, args, kwargs, roots, backward=backward, ops=window)
    finally:
        saved.load()
    events, starts, digests = _timeline(run, root)
    return Trace(
        source=_describe(fn) if source is None else source,
        recorded=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        seed=block.seed,
        backward=backward,
        environment=facts,
        structure=tuple(run.structure),
        starts=tuple(starts),
        events=tuple(events),
        digests=digests,
        ops=run.ops is not None,
    )


def script_result(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """What a trace of a script records as its return value: the script's global variables
    that hold tensors or NumPy arrays (directly or in lists, tuples, dicts and dataclasses).

    Names starting with ``_`` are left out, and so are numbers and strings: a
    script's globals hold timestamps and paths that differ from run to run.

    Example:
        >>> import torch
        >>> sorted(script_result({"loss": torch.ones(1), "start": 3.5, "_x": torch.ones(1)}))
        ['loss']
    """
    # A module is a leaf, no array: its parameters are fingerprinted as the final state.
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_")
        and any(isinstance(leaf, (torch.Tensor, np.ndarray)) for _, leaf in leaves(value, ""))
    }


def _check_directory(path: str) -> None:
    """Fail before the run, not after it, when the trace could not be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"path: the directory {directory!r} of {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"path: {path!r} is a directory")


def _describe(fn: object) -> str:
    if isinstance(fn, torch.nn.Module):
        return f"module {type(fn).__qualname__}"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"function {module}.{name}" if module not in (None, "__main__") else f"function {name}"


def _timeline(run: Run, root: str) -> tuple[list[Event], list[int], bytes]:
    """The timeline of a trace of ``run``: its events with digests for its fingerprints,
    its op calls (if it recorded them) as ``"op"`` events, and its return value's leaves
    (named from ``root``) as ``"result"`` events before the final state; where each module
    call starts in it; and the digests, 16 bytes each."""
    table: dict[bytes, int] = {}

    def slot(digest: bytes | None) -> tuple[int, int, int] | None:
        if digest is None:
            return None
        index = table.setdefault(digest, len(table))
        return (0, DIGEST * index, DIGEST * (index + 1))

    events: list[Event] = []
    for e in run.events:
        digests = [None if f is None else _digest(f) for f in run.fingerprints(e)]
        events.append(dataclasses.replace(e, slots=tuple([slot(d) for d in digests])))
    starts = list(run.starts)
    if run.ops is not None:
        events, starts = _with_op_events(run, events, slot)
    results = []
    for path, leaf in leaves(run.result, root):
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
    return events, starts, b"".join(table)


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
        label: tuple[str | None, str | None, str | None] = (
            NO_MODULE if inside is None else run.structure[inside]
        )
        # Its inputs from outside the recorded ops, then its outputs (the order
        # first_op_difference checks).
        prints = (*call.inputs, *call.outputs)
        where = dataclasses.replace(call, location=_relative(call.location, os.getcwd()))
        merged.append(
            Event(
                ("op", started, n),
                "op",
                where.described(),
                *label,
                inside,
                tuple([p.path for p in prints]),
                tuple([p.shape for p in prints]),
                tuple([p.dtype for p in prints]),
                tuple(
                    [
                        slot(None if p.fingerprint is None else _digest(p.fingerprint))
                        for p in prints
                    ]
                ),
            )
        )
    merged += events[placed:]
    # Op calls made before a module call started are exactly the first at_calls[c].
    return merged, [s + k for s, k in zip(starts, at_calls, strict=True)]


@functools.lru_cache(maxsize=4096)  # per line: a run makes many op calls at few lines
def _relative(location: str | None, directory: str) -> str | None:
    """``file:line`` with a file under ``directory`` (the working directory) relative to
    it: the same script in two checkouts has the same name in both traces."""
    file, colon, line = (location or "").rpartition(":")
    if not colon or not os.path.isabs(file):
        return location
    try:
        relative = os.path.relpath(file, directory)
    except ValueError:  # another drive (Windows)
        return location
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return location
    return f"{relative}:{line}"


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST).digest()


def _leaf_digest(leaf: object) -> tuple[tuple[int, ...], str, bytes | None]:
    """Shape, dtype (a type name for Python values) and digest of one leaf; ``None``
    for a leaf compared by type only (an object of another kind)."""
    if isinstance(leaf, torch.Tensor):
        parts = fingerprint_parts(leaf)
        data = None if parts is None else b"".join(p.cpu().numpy().tobytes() for p in parts)
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
    elif isinstance(leaf, (float, complex)):
        raw = float_bits(leaf)  # by its bits, as compare does: -0.0 is not 0.0
    elif isinstance(leaf, str):
        raw = leaf.encode("utf-8", "surrogatepass")
    elif isinstance(leaf, bytes):
        raw = leaf
    else:
        raw = None
    return (), type(leaf).__qualname__, None if raw is None else _digest(raw)
