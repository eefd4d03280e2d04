"""What :func:`~deterministic_ctx.audit.audit_nondeterminism` found: :class:`AuditFinding`
(an op call, or several at one place) and :class:`AuditReport` (all of them, and notes)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .model import Behaviour, nearest_checked

__all__ = ["AuditFinding", "AuditReport"]


@dataclasses.dataclass(frozen=True)
class AuditFinding:
    """An op call (or several, at one place) that is nondeterministic on CUDA.

    Attributes:
        op: the aten overload, e.g. ``"aten.upsample_bilinear2d_backward.default"``
            (for a watched torch function, its qualified name).
        module: the qualified name of the module that made the call, within its
            root model (``""``: the root itself); ``None`` outside any module.
        module_type: that module's class name.
        location: the user's ``file:line`` (relative to the working directory
            when inside it); for a backward op, where its forward op was called.
        behaviour: what ``torch.use_deterministic_algorithms(True)`` (with the
            audit's ``warn_only``) does on CUDA: ``"raise"``, ``"warn"``,
            ``"deterministic"`` (switches to a deterministic kernel) or ``"none"``
            (nothing: the op stays nondeterministic, silently).
        phase: ``"forward"``, or ``"backward"`` (in autograd's backward pass).
        note: why, and what to do, from the table.
        condition: the table's condition on the arguments, in words.
        entry: the key of the table entry, e.g. ``"put-accumulate"``.
        count: how many calls at this place.
        exempted: whether an open ``allow_nondeterministic`` exempted the op from the
            deterministic check when it was called (its first call at this place).

    Example:
        >>> f = AuditFinding("aten.put_.default", None, None, "train.py:3", "raise", "forward", "")
        >>> f.where
        'train.py:3'
    """

    op: str
    module: str | None
    module_type: str | None
    location: str
    behaviour: Behaviour
    phase: str
    note: str
    condition: str = ""
    entry: str = ""
    count: int = 1
    exempted: bool = False

    @property
    def where(self) -> str:
        """``decoder.up (Upsample) at model.py:41``-style place, for messages."""
        if self.module is None:
            return self.location
        return f"{self.module or '(root)'} ({self.module_type}) at {self.location}"


_VERBS: dict[str, str] = {
    "raise": "it raises (no deterministic CUDA kernel)",
    "warn": "it warns and stays nondeterministic",
    "deterministic": "it becomes deterministic",
    "none": "it stays nondeterministic, with no error or warning",
}


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What :func:`audit_nondeterminism` found.

    ``findings`` in the order they first happened; ``calls`` counts the aten op
    calls audited; ``backward`` says whether a backward pass was audited (run
    by ``fn`` or by the audit); ``warn_only`` is the audit's; ``checked_against``
    is the release of the table's checks that the behaviours come from (the
    running one, or the nearest checked one before it); ``notes`` are facts
    beside the findings (a torch release the table was not checked against, a
    missing ``CUBLAS_WORKSPACE_CONFIG`` before torch 2.10, no backward to audit).

    Like a list of findings, a report is true when it has any: ``if report:``
    reads "if something was found"; :attr:`clean` says the opposite.

    Example:
        >>> import torch
        >>> from deterministic_ctx import audit_nondeterminism
        >>> report = audit_nondeterminism(torch.nn.Linear(2, 2), torch.ones(1, 2))
        >>> report.clean, bool(report), len(report)
        (True, False, 0)
    """

    findings: tuple[AuditFinding, ...]
    calls: int
    backward: bool
    warn_only: bool
    torch_version: str
    checked_against: str
    notes: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        """Whether no op call was found."""
        return not self.findings

    @property
    def raising(self) -> tuple[AuditFinding, ...]:
        """The findings for which deterministic mode raises: where it would stop a run."""
        return tuple(f for f in self.findings if f.behaviour == "raise")

    def __bool__(self) -> bool:
        return bool(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ints, strings, lists, dicts and ``None`` only.

        Example:
            >>> import json, torch
            >>> from deterministic_ctx import audit_nondeterminism
            >>> report = audit_nondeterminism(torch.nn.Linear(2, 2), torch.ones(1, 2))
            >>> json.loads(json.dumps(report.to_dict()))["clean"]
            True
        """
        out = dataclasses.asdict(self)
        out["findings"] = [{**dataclasses.asdict(f), "where": f.where} for f in self.findings]
        out["notes"] = list(self.notes)
        out["clean"] = self.clean
        return out

    def __str__(self) -> str:
        mode = "use_deterministic_algorithms(True" + (
            ", warn_only=True)" if self.warn_only else ")"
        )
        scope = "forward and backward" if self.backward else "forward only"
        if self.clean:
            checked = nearest_checked(self.checked_against).describe()
            lines = [
                f"No op call is nondeterministic on CUDA ({self.calls} aten op calls audited, "
                f"{scope}). Table checked against torch {checked}."
            ]
        else:
            raising = len(self.raising)
            lines = [
                f"{len(self.findings)} place(s) nondeterministic on CUDA ({self.calls} aten op "
                f"calls audited, {scope}); under {mode} {raising} would raise:"
            ]
            explained: dict[tuple[str, str], int] = {}  # each note once: later ones point back
            for n, f in enumerate(self.findings, 1):
                calls = f"{f.count} call" + ("s" if f.count != 1 else "")
                exempt = ", exempted by allow_nondeterministic" if f.exempted else ""
                lines.append(f"  {n}. {f.op} ({f.phase}, {calls}{exempt}) in {f.where}")
                condition = f"when {f.condition}: " if f.condition else ""
                lines.append(f"     {condition}under {mode} {_VERBS[f.behaviour]}.")
                first = explained.setdefault((f.entry, f.note), n)
                lines.append(f"     {f.note}" if first == n else f"     (See {first}.)")
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)
