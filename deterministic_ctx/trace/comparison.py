"""Comparing two traces: the first module call (or op call) whose fingerprints differ, named
as :func:`~deterministic_ctx.verify.locate.locate_divergence` names it, and the facts that differ.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import Any

from ..verify.compare import short_repr
from ..verify.locate import Agreement, Divergence, divergence_of
from ..verify.ops import OpCall, TensorPrint, first_op_difference
from ..verify.record import Event, Run
from ..verify.timeline import Finding, compare_runs
from .culprits import EnvironmentDifference, environment_differences
from .fileformat import Trace


@dataclasses.dataclass(frozen=True)
class TraceComparison(Agreement):
    """What :func:`compare_traces` found.

    ``agree`` is true when every fingerprint of the two traces matched (module
    outputs, gradients, the return value, final parameters and buffers);
    otherwise ``divergence`` is the first difference in A's call order, named
    as :class:`~deterministic_ctx.verify.locate.Divergence` names it for
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
            lines = [f"Traces diverge: B differs from A first at {d.where}"]
        lines += [f"  A: {self.a}", f"  B: {self.b}"]
        if d is not None:
            lines += d.lines(self.compared)
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
        >>> from deterministic_ctx import record_trace
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
    drop: set[str] = set()  # phases that only one trace recorded: left out of both
    for phase, flag, what in (("backward", "backward", "gradients"), ("op", "ops", "op events")):
        in_a, in_b = getattr(trace_a, flag), getattr(trace_b, flag)
        if in_a != in_b:
            drop.add(phase)
            notes.append(
                f"only {'A' if in_a else 'B'} recorded {what} ({flag}=True): compared without them"
            )
    if trace_a.status != trace_b.status:
        notes.append(
            f"the scripts exited with status {trace_a.status} (A) and {trace_b.status} (B)"
        )
    run_a, run_b = _as_run(trace_a, drop), _as_run(trace_b, drop)
    unfilled = False in (trace_a.environment.get(_FILL), trace_b.environment.get(_FILL))
    finding, agreed = compare_runs(run_a, run_b, run=2, names=("A", "B"))
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
    """The trace as a recorded run for :func:`~deterministic_ctx.verify.timeline.compare_runs`,
    without the events of the phases in ``drop``."""
    kept = [e.phase not in drop for e in trace.events]
    before = list(itertools.accumulate(kept, initial=0))  # events kept among the first i
    starts = [before[s] for s in trace.starts]
    # The events as a recording's records, whose slots point into one buffer, the digests;
    # the return value is in the events.
    records = [
        (
            e.key,
            e.phase,
            e.what,
            (e.root, e.module, e.module_type),
            e.call_index,
            tuple(zip(e.paths, e.shapes, e.dtypes, e.slots, strict=True)),
        )
        for e, keep in zip(trace.events, kept, strict=True)
        if keep
    ]
    return Run(records, [trace.digests], None, list(trace.structure), starts, None)


def _divergence(finding: Finding, a: Run, b: Run, unfilled: bool = False) -> Divergence:
    """The public description of ``finding``, trace B (``b``) against trace A (``a``);
    ``unfilled``: a trace was recorded without filling uninitialized memory."""
    e = finding.event
    detail = finding.detail
    kind = finding.kind
    op: tuple[str | None, str | None, str | None] = (None, None, None)
    if e.phase == "op":
        kind, op = _op_divergence(finding, a, b)
        if unfilled and op[0] is not None and op[0].startswith(_UNINITIALIZED):
            op = (op[0], op[1], f"{op[2]}; {_UNFILLED}")
    if finding.kind == "values":
        detail = (
            f"the fingerprints of {e.paths[finding.leaf]} differ (a trace keeps fingerprints, "
            "not values: where and by how much is unknown)"
        )
    return divergence_of(finding, 2, op, kind=kind, index=None, max_abs_diff=None, detail=detail)


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
    as :func:`~deterministic_ctx.verify.locate.locate_divergence` names them: the op calls of the
    two traces at that point, compared by :func:`~deterministic_ctx.verify.ops.first_op_difference`
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


#: ``what`` of an op event: :meth:`~deterministic_ctx.verify.ops.OpCall.described`'s format.
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
