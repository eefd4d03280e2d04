"""``locate_divergence``: the first module call where two runs of PyTorch code differ.

When :func:`~deterministic_ctx.verify.assert_reproducible` says a model is not
reproducible, the next question is *where*.  ``locate_divergence`` runs the
code twice in fresh ``deterministic(seed)`` blocks with global module hooks
that fingerprint, in call order, the outputs of every module call (and, with
``backward=True``, the gradients flowing into each call's inputs and
parameters), then the return value and the final parameters and buffers.
The first fingerprint that differs names the module.

Fingerprints are computed where the tensor lives, without copying it to the
host: the row and column sums of its bytes read as a table of int64 words
(wrapping, so exact), which change with any single element and when two
elements trade places.  A run keeps only these, about ``2 * sqrt(n)`` words
for a tensor of ``n`` words, and moves them to the host once, at its end.
Two runs that recorded exactly the same (calls, events, fingerprint bytes)
and returned equal values are found equal in one comparison of what they
recorded; the event-by-event walk is for runs that differ.  Only when the
runs diverge are two more runs made, which keep the one differing tensor, to
report the first differing index and the max difference.

With ``ops=True`` those two re-runs also record, under a dispatch mode
(:mod:`.ops`), the aten op calls of just the stretch where the difference
must have arisen, and the first op call whose result differs between them is
named with the user's ``file:line``.  That stretch is:

* a module's output differs: the op calls *during that module call* (its
  children's included), found by its call index.  When what differs first
  there is a tensor the call read but did not make (its input, made by code
  between module calls, or a parameter), two more re-runs record the op calls
  from the start of ``fn`` until that call starts, and the first that differs
  there is named; when none does, no op is named and ``op_detail`` says so;
* the two runs called different modules (control flow): the op calls from
  the start of ``fn`` until that call starts;
* a gradient differs: the op calls autograd's engine runs, from the start of
  the backward pass until that gradient is recorded (these re-runs note where
  each forward op that made an autograd node was called, so that built-in
  backward formulas are placed at the forward line that made their autograd
  node);
* the return value or a final parameter differs (every module call agreed):
  every op call of ``fn``.

In every stretch, a differing tensor that an op only read and that no
recorded op made names no op: ``op`` stays ``None`` and ``op_detail`` names
the op that read it, and says the tensor came from outside the stretch.

Recording costs a pass through Python per op call made while the dispatch
mode is on (about 20 µs on a CPU) and fingerprints of each recorded op's
outputs and outside inputs; the mode is on only for the stretch, except that
backward, control-flow and whole-run stretches keep it on from the start of
``fn``.  When the runs agree, ``ops=True`` records nothing and costs
nothing.  On a 6-block MLP (a busy 2-core CPU) it added about 10% to
``locate_divergence`` for a module's output, 1.8 times for a gradient
(the backward pass recorded) and 4 times for a whole training step.

This module builds the report; the work is done by :mod:`.record` (hooks
that record one run), :mod:`.timeline` (the first difference between two
recorded runs), :mod:`.ops` (op calls, and the first that differs),
:mod:`.fingerprint`, :mod:`.compare` (return values and captured tensors)
and :mod:`.rerun` (arguments, and inputs put back between runs), the last
two shared with :mod:`.verify`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..core.context import deterministic
from ..internal import exempted_calls
from .compare import short_repr, tensor_difference
from .ops import OpDifference, first_op_difference
from .record import OpWindow, Run, record
from .rerun import check_runs, exempted_since, prepare_runs, suspects
from .timeline import Finding, compare_runs

__all__ = ["Agreement", "Divergence", "DivergenceReport", "divergence_of", "locate_divergence"]


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs first differ.

    Attributes:
        phase: ``"forward"`` (a module's output), ``"backward"`` (a gradient),
            ``"result"`` (the return value, when every module call agreed) or
            ``"final"`` (a parameter or buffer after ``fn`` returned).
        kind: ``"values"``, ``"shape"`` (shapes or dtypes), ``"call"`` (another
            module was called at that point), ``"missing"`` or ``"extra"`` (a
            call or gradient present in only one run).
        module: qualified name of the module within its root model (``""`` is
            the root itself); ``None`` for the return value.
        module_type: the module's class name.
        root: the class name of the root model.
        call_index: 0-based index of the module call, in the order calls start.
        what: which tensor, e.g. ``"output"``, ``"output[1]"``,
            ``"gradient w.r.t. input[0]"`` or ``'result["loss"]'``.
        shapes / other_shapes: shapes of the tensors in run 1 / the other run.
        index: first differing element, when known.
        max_abs_diff: largest absolute difference, when known.
        run: the run that differed from run 1.
        detail: one readable sentence.
        op: with ``ops=True``, the first aten op call whose result differs
            between two more runs, e.g. ``"aten.index_add_.default"``; ``None``
            without ``ops=True``, when none differed, or when what differed first
            is a tensor that no recorded op made (``op_detail`` names its reader).
        op_location: ``"file:line"`` of the user's code that called that op
            (library frames skipped; in a backward pass, the line of a custom
            ``backward``, else the forward line that made the autograd node).
            Named apart from :attr:`location`, the module's name, which it
            refines.
        op_detail: with ``ops=True``, one sentence on what the op-level re-runs
            found, including why no op was named when none is.
    """

    phase: str
    kind: str
    module: str | None
    module_type: str | None
    root: str | None
    call_index: int | None
    what: str
    shapes: tuple[tuple[int, ...], ...]
    other_shapes: tuple[tuple[int, ...], ...]
    index: tuple[int, ...] | None
    max_abs_diff: float | None
    run: int
    detail: str
    op: str | None = None
    op_location: str | None = None
    op_detail: str | None = None

    @property
    def location(self) -> str:
        """``blocks.3.noise (Jitter)``-style name of the place, for messages."""
        if self.module is None:
            return self.what
        name = self.module or "(root)"
        return f"{name} ({self.module_type})"

    @property
    def where(self) -> str:
        """``module call #3, blocks.3.noise (Jitter), forward output``-style, for reports."""
        if self.phase == "forward":
            where = f"module call #{self.call_index}, {self.location}"
            if self.kind in ("call", "missing", "extra"):
                return where
            return f"{where}, forward {self.what}"
        if self.phase == "backward":
            return f"{self.location} (call #{self.call_index}), backward: {self.what}"
        if self.phase == "final":
            return f"{self.location}: {self.what}"
        if self.phase == "op":  # in traces recorded with ops=True
            op = self.what if self.op is None else self.op
            if self.op_location is not None:
                op += f" at {self.op_location}"
            if self.module is None:
                return f"{op}, outside any module call"
            return f"{op} in module call #{self.call_index}, {self.location}"
        return f"the return value at {self.what}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data, with :attr:`location`."""
        out = dataclasses.asdict(self)
        out["shapes"] = [list(s) for s in self.shapes]
        out["other_shapes"] = [list(s) for s in self.other_shapes]
        out["index"] = None if self.index is None else list(self.index)
        out["location"] = self.location
        return out

    def lines(self, compared: int) -> list[str]:
        """The lines of a report below its first, ``compared`` fingerprints having agreed."""
        lines = []
        if self.root is not None and self.module is not None:
            lines.append(f"  in model {self.root}; module call order counts from 0")
        if self.shapes:
            lines.append(f"  shapes: {', '.join(map(str, self.shapes))}")
        lines.append(f"  {self.detail}")
        if self.op_detail is not None:
            lines.append(f"  first differing op: {self.op_detail}")
        return [*lines, f"  {compared} earlier fingerprint(s) agree"]


class Agreement:
    """What a report on two runs (or two traces) has: ``divergence``, where they first
    differ (``None`` where nowhere), ``agree`` and ``to_dict()``."""

    divergence: Divergence | None

    @property
    def agree(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ints, strings, lists, dicts, bools, floats and ``None`` only.

        Example:
            >>> import json, torch
            >>> report = locate_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2))
            >>> json.loads(json.dumps(report.to_dict()))["agree"]
            True
        """
        fields = dataclasses.asdict(self)  # type: ignore[call-overload]  # a dataclass's
        out: dict[str, Any] = {"agree": self.agree, **fields}
        for name, value in fields.items():
            if isinstance(value, tuple):
                out[name] = list(value)
        if self.divergence is not None:
            out["divergence"] = self.divergence.to_dict()
        return out


@dataclasses.dataclass(frozen=True)
class DivergenceReport(Agreement):
    """What :func:`locate_divergence` found.

    ``agree`` is true when every recorded fingerprint, the return value and
    the final parameters matched in all runs; otherwise ``divergence`` says
    where the runs first differ.  ``calls`` is the number of module calls in
    run 1, ``compared`` the number of fingerprinted events (outputs, gradients,
    final tensors) that agreed before the divergence, or in all; ``ops``
    whether the first differing op was looked for.
    ``exempted`` names the ops exempted from the deterministic check
    (``allow_nondeterministic``) that ran in the run that differs: suspects.
    ``str(report)`` is a readable summary and ``to_dict()`` a JSON-serializable one.
    """

    seed: int
    runs: int
    backward: bool
    calls: int
    compared: int
    divergence: Divergence | None
    ops: bool = False
    exempted: tuple[str, ...] = ()

    def __str__(self) -> str:
        d = self.divergence
        if d is None:
            grads = " and gradients" if self.backward else ""
            return (
                f"Runs agree (seed={self.seed}, {self.runs} runs): {self.calls} module calls per "
                f"run; all {self.compared} fingerprints of outputs{grads}, final parameters and "
                "buffers, and the return values are identical."
            )
        first = f"Runs diverge (seed={self.seed}): run {d.run} differs from run 1 first at"
        suspect = suspects(self.exempted, d.run)
        return "\n".join([f"{first} {d.where}", *d.lines(self.compared), *filter(None, [suspect])])


def locate_divergence(
    fn: Callable[..., Any],
    /,
    *args: Any,
    seed: int = 0,
    runs: int = 2,
    backward: bool = False,
    ops: bool = False,
    warn_only: bool = False,
    reset: Iterable[Any] = (),
    **kwargs: Any,
) -> DivergenceReport:
    """Run ``fn`` ``runs`` times under ``seed``; name the first module call that differs.

    ``fn`` is a model (``locate_divergence(model, x)``) or any function that
    uses modules, such as a whole training step.  Every run is a fresh
    ``deterministic(seed, warn_only=warn_only)`` block with global forward
    hooks that fingerprint each module call's outputs, in call order, on the
    tensors' own devices.  With ``backward=True`` the gradients w.r.t. each
    call's positional tensor inputs and each module's own parameters are
    fingerprinted too (tensor hooks; modules with in-place ops are fine).
    Then the return values are compared exactly, and the parameters and
    buffers of every model seen are fingerprinted once more.

    The first difference in run 1's order is reported: a module's output,
    a gradient, the return value, or a final parameter (for example when only
    the optimizer step is nondeterministic).  On a divergence two more runs
    keep that one tensor, to report the first differing index and the max
    difference.  With ``ops=True`` those re-runs (or two, when none were
    needed) also record the aten op calls where the difference must have
    arisen (see the module's docstring: the differing module call, the
    backward pass up to the differing gradient, or the whole run), and
    ``divergence.op`` / ``divergence.op_location`` name the first op call whose
    result differs and the user's ``file:line`` that made it.  Modules and
    optimizers passed as ``fn`` or as direct arguments, and the objects in
    ``reset``, are put back to their state before every run and after the
    last, exactly as :func:`assert_reproducible` does.

    Calls from other threads are ignored; keyword tensor inputs get no
    gradient fingerprints; names are relative to the first model the module
    was found in (a model among the arguments or in ``reset``, else the first
    module called).

    Example:
        >>> import torch
        >>> from deterministic_ctx import locate_divergence
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> report = locate_divergence(model, torch.ones(2, 4))
        >>> report.agree, report.calls
        (True, 4)
        >>> locate_divergence(model, torch.ones(2, 4), ops=True).agree  # nothing to drill into
        True
    """
    block = deterministic(seed, warn_only=warn_only)
    runs = check_runs(runs)
    objects, saved = prepare_runs(fn, args, kwargs, reset, backward=backward, ops=ops)
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]

    def again(capture: tuple[Any, ...] | None = None, window: OpWindow | None = None) -> Run:
        saved.load()  # every run after the first starts from the saved state
        return record(
            block, fn, args, kwargs, roots, backward=backward, capture=capture, ops=window
        )

    drilled: tuple[str | None, str | None, str] | None = None
    try:
        first = record(block, fn, args, kwargs, roots, backward=backward)
        finding: Finding | None = None
        agreed = 0
        run = 1
        exempted: tuple[str, ...] = ()
        for run in range(2, runs + 1):
            calls = exempted_calls()
            finding, agreed = compare_runs(first, again(), run)
            if finding is not None:
                exempted = exempted_since(calls)
                break
        if finding is not None:
            # The same two re-runs keep the differing tensor and record the op calls.
            key = finding.event.key if finding.kind == "values" else None
            window = _op_window(finding) if ops else None
            numbers = (runs + 1, runs + 2)
            reruns: tuple[Run, Run] | None = None
            if window is not None:
                reruns, diff, drilled = _first_op(again, window, numbers, key)
                if diff is not None and diff.from_outside and window.call is not None:
                    # The call read a tensor made before it started (by code between
                    # module calls): record from the start of fn up to the call.
                    drilled = _made_before(again, window.call, diff, (runs + 3, runs + 4))
            if key is not None:
                if reruns is None:
                    reruns = (again(key), again(key))
                finding = _measured(finding, reruns, numbers)
    finally:
        saved.load()
    return DivergenceReport(
        seed=block.seed,
        runs=runs,
        backward=backward,
        calls=len(first.structure),
        compared=agreed,
        divergence=None if finding is None else divergence_of(finding, run, drilled),
        ops=ops,
        exempted=exempted if finding is not None else (),
    )


def _op_window(finding: Finding) -> OpWindow:
    """Where the op calls that made ``finding`` ran: see the module's docstring."""
    e = finding.event
    if e.phase == "forward" and e.call_index is not None:
        if e.what == "call":  # the call sequences part here: what decided it ran before
            return OpWindow(before_call=e.call_index)
        return OpWindow(call=e.call_index)
    if e.phase == "backward":
        return OpWindow(until=e.key, backward=True)
    return OpWindow()  # the return value or a final tensor: anywhere in fn


def _first_op(
    again: Callable[[tuple[Any, ...] | None, OpWindow | None], Run],
    window: OpWindow,
    numbers: tuple[int, int],
    capture: tuple[Any, ...] | None = None,
) -> tuple[tuple[Run, Run] | None, OpDifference | None, tuple[str | None, str | None, str]]:
    """Two re-runs (numbered ``numbers``) that record the op calls of ``window`` (and keep
    the tensors of the event ``capture``), the first op call that differs between them,
    and ``(op, op_location, op_detail)`` for it; no re-runs where recording raised."""
    where = window.describe()
    try:
        reruns = (again(capture, window), again(capture, window))
    except Exception as err:
        # The dispatch mode broke fn (a higher-order op, code that compiles itself, ...):
        # keep the module-level report, say why no op is named.
        message = short_repr(str(err).strip().split("\n", 1)[0])[1:-1]  # one line, cut short
        detail = (
            f"none: a re-run that records the op calls {where} raised "
            f"{type(err).__name__}: {message} (the runs without the recording did not); the "
            "module-level report above stands"
        )
        return None, None, (None, None, detail)
    a, b = (r.ops or [] for r in reruns)
    left, right = (f"run {n}" for n in numbers)
    diff = first_op_difference(a, b, left=left, right=right)
    if diff is None:
        if not a:
            detail = (
                f"none: no aten op ran {where} in {left} or {right}; the difference comes from "
                "Python code (e.g. a module that returns another tensor, or a number)"
            )
        else:
            detail = (
                f"none: {left} and {right} recorded {len(a)} op call(s) {where} and agree on "
                "every one, so the difference comes and goes, or it comes from outside torch "
                "ops (e.g. a tensor changed through NumPy)"
            )
        return reruns, None, (None, None, detail)
    call = diff.call
    if diff.kind in ("op", "missing", "extra"):
        detail = f"after {diff.index} op call(s) that agree {where}, {diff.detail}"
    else:
        count = f"op call #{diff.index} of {len(a)} recorded {where} in {left}"
        detail = f"{call.described()}, {count}: {diff.detail}"
    if diff.from_outside:
        # That op only read the tensor: naming it would blame an innocent op.
        return reruns, diff, (None, None, f"none: {detail}")
    return reruns, diff, (call.op, call.location, detail)


def _made_before(
    again: Callable[[tuple[Any, ...] | None, OpWindow | None], Run],
    index: int,
    read: OpDifference,
    numbers: tuple[int, int],
) -> tuple[str | None, str | None, str]:
    """``(op, op_location, op_detail)`` when module call #``index`` read a differing
    tensor that it did not make (``read``): the first op call that differs in two more
    re-runs (numbered ``numbers``) that record from the start of ``fn`` until the call."""
    window = OpWindow(before_call=index)
    reader = (
        f"module call #{index} read a differing tensor that no op during the call made "
        f"({read.what}, read by {read.call.described()})"
    )
    reruns, diff, (op, location, detail) = _first_op(again, window, numbers)
    if reruns is not None and diff is None:
        detail = (
            f"none: {reader}, and {detail[6:]}; so it was changed outside torch ops "
            "(e.g. through NumPy or a data pointer), or the difference comes and goes"
        )
    elif op is None:
        detail = f"none: {reader}; {detail[6:]}"
    else:
        detail = f"{reader}; the first op call before the call that differs: {detail}"
    return op, location, detail


def _measured(finding: Finding, reruns: tuple[Run, Run], numbers: tuple[int, int]) -> Finding:
    """``finding`` of differing fingerprints, with the index and size of the difference
    from two more runs (numbered ``numbers``) that kept the tensor."""
    first, second = (r.captured for r in reruns)
    if first is None or second is None or min(len(first), len(second)) <= finding.leaf:
        detail = "values differ (the re-runs that would show by how much took another path)"
        return dataclasses.replace(finding, detail=detail)
    (path, x), (_, y) = first[finding.leaf], second[finding.leaf]
    found = tensor_difference(x, y, path)
    if found is None:
        detail = (
            "values differ (their fingerprints do), but two re-runs agreed here, so the "
            "difference is intermittent; the max difference is unknown"
        )
        return dataclasses.replace(finding, detail=detail)
    left, right = (f"run {n}" for n in numbers)
    return dataclasses.replace(
        finding,
        detail=found.describe(left, right),
        index=found.index,
        max_abs_diff=found.max_abs_diff,
    )


def divergence_of(
    finding: Finding,
    run: int,
    drilled: tuple[str | None, str | None, str | None] | None = None,
    **replaced: Any,
) -> Divergence:
    """The public description of ``finding``, where run ``run`` differed from run 1, and
    of the op found by ``drilled``, if it ran; ``replaced``: fields said otherwise."""
    e = finding.event
    what = e.what
    if finding.kind == "values" and e.phase == "forward" and len(e.paths) > 1:
        what = e.paths[finding.leaf]  # which output of several
    op, op_location, op_detail = (None, None, None) if drilled is None else drilled
    fields = {
        "phase": e.phase,
        "kind": finding.kind,
        "module": e.module,
        "module_type": e.module_type,
        "root": e.root,
        "call_index": e.call_index,
        "what": what,
        "shapes": e.shapes,
        "other_shapes": () if finding.other is None else finding.other.shapes,
        "index": finding.index,
        "max_abs_diff": finding.max_abs_diff,
        "run": run,
        "detail": finding.detail,
    }
    return Divergence(**{**fields, **replaced}, op=op, op_location=op_location, op_detail=op_detail)
