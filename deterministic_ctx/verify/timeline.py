"""Comparing two recorded runs: the first difference in run 1's timeline.

The timeline of a run is the module outputs and gradients as they happened
(a module call that differs between the two call sequences sits where it
started), then the return value, then the gradients, parameters and buffers
after ``fn`` returned.  :func:`compare_runs` walks run 1's timeline and
returns the first place where the other run differs, as a :class:`Finding`.

Example:
    >>> import torch
    >>> from deterministic_ctx import deterministic
    >>> from deterministic_ctx.verify.record import record
    >>> from deterministic_ctx.verify.timeline import compare_runs
    >>> model = torch.nn.Linear(2, 2)
    >>> def step():
    ...     return model(torch.randn(1, 2))
    >>> runs = [record(deterministic(0), step, (), {}, [model], backward=False) for _ in "ab"]
    >>> finding, agreed = compare_runs(*runs, run=2)
    >>> finding is None, agreed
    (True, 3)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

from .compare import first_difference
from .record import Event, Run

__all__ = ["Finding", "compare_runs"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """The first difference between two runs.

    ``kind`` is ``"values"`` (fingerprints differ: ``leaf`` is which tensor of
    the event), ``"shape"``, ``"call"``, ``"missing"``, ``"extra"`` or ``"result"``
    (the return values differ; ``index`` and ``max_abs_diff`` say where and by
    how much).  ``event`` is where, in run 1 (in the other run for ``"extra"``),
    ``other`` the other run's event when both have one.

    Example:
        >>> Finding("result", Event(("result",), "result", "result[0]"), detail="1 != 2").kind
        'result'
    """

    kind: str
    event: Event
    other: Event | None = None
    leaf: int = 0
    detail: str = ""
    index: tuple[int, ...] | None = None
    max_abs_diff: float | None = None


def compare_runs(
    a: Run, b: Run, run: int, names: tuple[str, str] | None = None
) -> tuple[Finding | None, int]:
    """The first difference between run 1 (``a``) and run ``run`` (``b``) in run 1's
    timeline, and how many events agreed before it (or in all).  The details name the
    runs ``names`` (default: ``"run 1"`` and ``"run {run}"``).

    Runs that recorded exactly the same and returned equal values are found equal
    in one comparison of their records (:meth:`~deterministic_ctx.verify.record.Run.agreement`),
    with the count the walk gives them, and without making their events; any other
    pair is walked event by event.  See the module's example.
    """
    agreed = a.agreement(b)
    if agreed is not None and first_difference(a.result, b.result) is None:
        return None, agreed
    comparison = _Comparison(a, b, names or ("run 1", f"run {run}"))
    return comparison.first(), comparison.agreed


class _Comparison:
    """One walk through run 1's timeline, matching the other run's events by key; the
    details name the runs ``names``."""

    def __init__(self, a: Run, b: Run, names: tuple[str, str]) -> None:
        self._a, self._b, self._names = a, b, names
        self._unmatched = {e.key: e for e in b.events}
        self.agreed = 0

    def first(self) -> Finding | None:
        """The first difference in timeline order; ``agreed`` counts the events before it."""
        a = self._a
        during = itertools.takewhile(lambda e: e.phase != "final", a.events)
        structural = _structural(a, self._b, self._names)
        if structural is not None:
            position, call = structural
            # The call sequences part at ``position``: what happened before it, then the call.
            return self._check_all(itertools.islice(during, position)) or call
        return (
            self._check_all(during)
            or self._extra(final=False)
            or self._result()
            or self._check_all(e for e in a.events if e.phase == "final")
            or self._extra(final=True)
        )

    def _check_all(self, events: Iterable[Event]) -> Finding | None:
        for ea in events:
            found = self._check(ea)
            if found is not None:
                return found
            self.agreed += 1
        return None

    def _check(self, ea: Event) -> Finding | None:
        left, right = self._names
        eb = self._unmatched.pop(ea.key, None)
        if eb is None:
            return Finding("missing", ea, detail=f"{left} recorded it, {right} did not")
        if (ea.paths, ea.shapes, ea.dtypes) != (eb.paths, eb.shapes, eb.dtypes):
            detail = (
                f"shapes/dtypes differ: {_described(ea)} ({left}) vs {_described(eb)} ({right})"
            )
            return Finding("shape", ea, eb, detail=detail)
        pairs = zip(self._a.fingerprints(ea), self._b.fingerprints(eb), strict=True)
        for leaf, (x, y) in enumerate(pairs):
            if x is not None and y is not None and x != y:
                return Finding("values", ea, eb, leaf=leaf)
        return None

    def _extra(self, final: bool) -> Finding | None:
        left, right = self._names
        for eb in self._b.events:
            if eb.key in self._unmatched and (eb.phase == "final") == final:
                return Finding("extra", eb, detail=f"{right} recorded it, {left} did not")
        return None

    def _result(self) -> Finding | None:
        diff = first_difference(self._a.result, self._b.result)
        if diff is None:
            return None
        return Finding(
            "result",
            Event(("result",), "result", diff.path),
            detail=diff.describe(*self._names),
            index=diff.index,
            max_abs_diff=diff.max_abs_diff,
        )


def _structural(a: Run, b: Run, names: tuple[str, str]) -> tuple[int, Finding] | None:
    """The first module call that differs between the runs' call sequences, if any, with
    its position in run 1's timeline."""
    left, right = names
    for index, (x, y) in enumerate(zip(a.structure, b.structure, strict=False)):
        if x != y:
            detail = f"{left} called {_label(x)} here, {right} called {_label(y)}"
            return a.starts[index], Finding("call", _call_event(index, x), detail=detail)
    index = min(len(a.structure), len(b.structure))
    if len(a.structure) > index:
        call = a.structure[index]
        detail = f"{left} called {_label(call)} here; {right} made no more module calls"
        return a.starts[index], Finding("missing", _call_event(index, call), detail=detail)
    if len(b.structure) > index:
        call = b.structure[index]
        detail = f"{right} called {_label(call)} here; {left} made no more module calls"
        position = sum(e.phase != "final" for e in a.events)
        return position, Finding("extra", _call_event(index, call), detail=detail)
    return None


def _described(event: Event) -> list[tuple[tuple[int, ...], str]]:
    return list(zip(event.shapes, event.dtypes, strict=True))


def _label(call: tuple[str, str, str]) -> str:
    return f"{call[1] or '(root)'} ({call[2]})"


def _call_event(index: int, call: tuple[str, str, str]) -> Event:
    root, name, module_type = call
    return Event(
        ("forward", index),
        "forward",
        "call",
        root=root,
        module=name,
        module_type=module_type,
        call_index=index,
    )
