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
Only when the runs diverge are two more runs made, which keep the one
differing tensor, to report the first differing index and the max difference.

This module builds the report; the work is done by :mod:`.record` (hooks
that record one run), :mod:`.timeline` (the first difference between two
recorded runs), :mod:`.fingerprint`, :mod:`.compare` (return values and
captured tensors) and :mod:`.rerun` (arguments, and inputs put back between
runs), the last two shared with :mod:`.verify`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .compare import tensor_difference
from .context import deterministic
from .record import Run, record_run
from .rerun import SavedState, check_fn, check_runs, objects_to_reset
from .timeline import Finding, compare_runs

__all__ = ["Divergence", "DivergenceReport", "locate_divergence"]


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

    @property
    def location(self) -> str:
        """``blocks.3.noise (Jitter)``-style name of the place, for messages."""
        if self.module is None:
            return self.what
        name = self.module or "(root)"
        return f"{name} ({self.module_type})"


@dataclasses.dataclass(frozen=True)
class DivergenceReport:
    """What :func:`locate_divergence` found.

    ``agree`` is true when every recorded fingerprint, the return value and
    the final parameters matched in all runs; otherwise ``divergence`` says
    where the runs first differ.  ``calls`` is the number of module calls in
    run 1, ``compared`` the number of fingerprinted events (outputs, gradients,
    final tensors) that agreed before the divergence, or in all.
    ``str(report)`` is a readable summary and ``to_dict()`` a JSON-serializable one.
    """

    seed: int
    runs: int
    backward: bool
    calls: int
    compared: int
    divergence: Divergence | None

    @property
    def agree(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ints, strings, lists, dicts and ``None`` only.

        Example:
            >>> import json, torch
            >>> report = locate_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2))
            >>> json.loads(json.dumps(report.to_dict()))["agree"]
            True
        """
        out = dataclasses.asdict(self)
        out["agree"] = self.agree
        if self.divergence is not None:
            d = out["divergence"]
            d["shapes"] = [list(s) for s in self.divergence.shapes]
            d["other_shapes"] = [list(s) for s in self.divergence.other_shapes]
            d["index"] = None if self.divergence.index is None else list(self.divergence.index)
            d["location"] = self.divergence.location
        return out

    def __str__(self) -> str:
        d = self.divergence
        if d is None:
            grads = " and gradients" if self.backward else ""
            return (
                f"Runs agree (seed={self.seed}, {self.runs} runs): {self.calls} module calls per "
                f"run; all {self.compared} fingerprints of outputs{grads}, final parameters and "
                "buffers, and the return values are identical."
            )
        forward = f"module call #{d.call_index}, {d.location}"
        if d.kind not in ("call", "missing", "extra"):
            forward += f", forward {d.what}"
        where = {
            "forward": forward,
            "backward": f"{d.location} (call #{d.call_index}), backward: {d.what}",
            "final": f"{d.location}: {d.what}",
            "result": f"the return value at {d.what}",
        }[d.phase]
        lines = [
            f"Runs diverge (seed={self.seed}): run {d.run} differs from run 1 first at {where}"
        ]
        if d.root is not None and d.module is not None:
            lines.append(f"  in model {d.root}; module call order counts from 0")
        if d.shapes:
            lines.append(f"  shapes: {', '.join(map(str, d.shapes))}")
        lines.append(f"  {d.detail}")
        lines.append(f"  {self.compared} earlier fingerprint(s) agree")
        return "\n".join(lines)


def locate_divergence(
    fn: Callable[..., Any],
    /,
    *args: Any,
    seed: int = 0,
    runs: int = 2,
    backward: bool = False,
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
    difference.  Modules and optimizers passed as ``fn`` or as direct
    arguments, and the objects in ``reset``, are put back to their state before
    every run and after the last, exactly as :func:`assert_reproducible` does.

    Calls from other threads are ignored; keyword tensor inputs get no
    gradient fingerprints; names are relative to the first model the module
    was found in (a model among the arguments or in ``reset``, else the first
    module called).

    Example:
        >>> import torch
        >>> from deterministic_ctx.locate import locate_divergence
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> report = locate_divergence(model, torch.ones(2, 4))
        >>> report.agree, report.calls
        (True, 4)
    """
    block = deterministic(seed, warn_only=warn_only)
    runs = check_runs(runs)
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be True or False, got {backward!r}")
    check_fn(fn)
    objects = objects_to_reset(fn, args, kwargs, reset)
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]
    saved = SavedState(objects)

    def again(capture: tuple[Any, ...] | None = None) -> Run:
        saved.load()  # every run after the first starts from the saved state
        return record_run(block, fn, args, kwargs, roots, backward=backward, capture=capture)

    try:
        first = record_run(block, fn, args, kwargs, roots, backward=backward)
        finding: Finding | None = None
        agreed = 0
        run = 1
        for run in range(2, runs + 1):
            finding, agreed = compare_runs(first, again(), run)
            if finding is not None:
                break
        if finding is not None and finding.kind == "values":
            key = finding.event.key
            finding = _measured(finding, (again(key), again(key)), (runs + 1, runs + 2))
    finally:
        saved.load()
    return DivergenceReport(
        seed=block.seed,
        runs=runs,
        backward=backward,
        calls=len(first.structure),
        compared=agreed,
        divergence=None if finding is None else _divergence(finding, run),
    )


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


def _divergence(finding: Finding, run: int) -> Divergence:
    """The public description of ``finding``, where run ``run`` differed from run 1."""
    e = finding.event
    what = e.what
    if finding.kind == "values" and e.phase == "forward" and len(e.paths) > 1:
        what = e.paths[finding.leaf]  # which output of several
    return Divergence(
        phase=e.phase,
        kind=finding.kind,
        module=e.module,
        module_type=e.module_type,
        root=e.root,
        call_index=e.call_index,
        what=what,
        shapes=e.shapes,
        other_shapes=() if finding.other is None else finding.other.shapes,
        index=finding.index,
        max_abs_diff=finding.max_abs_diff,
        run=run,
        detail=finding.detail,
    )
