"""``audit_nondeterminism``: the ops of a run that are nondeterministic on CUDA, found on a CPU."""

from __future__ import annotations

from .recorder import AuditFinding, AuditReport, audit_nondeterminism

__all__ = ["AuditFinding", "AuditReport", "audit_nondeterminism"]
