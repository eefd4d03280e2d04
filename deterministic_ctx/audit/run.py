"""``audit_nondeterminism``: runs ``fn`` once under the audit's dispatch mode (and a backward
pass, when ``fn`` runs none) in a block that changes nothing global, and makes the report."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

from .._torch import release_of
from ..core.context import deterministic
from ..internal import CUBLAS_VALID
from ..verify.compare import short_repr, tensor_leaves
from ..verify.rerun import call_and_consume, prepare_runs
from .findings import AuditReport
from .model import (
    CHECKED_TORCH,
    CUBLAS_CONFIG_CHECKED_BEFORE,
    UncheckedTorchWarning,
    nearest_checked,
)
from .recorder import Auditor, Functions, Modules, watched_functions

__all__ = ["audit_nondeterminism"]


def _graph_leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (AccumulateGrad nodes) that ``outputs``' graph reaches."""
    leaves: dict[int, torch.Tensor] = {}
    # Visited nodes by id, kept referenced: while a node's Python object is alive, torch
    # hands out that object for the node, so ids neither change nor recur for another node
    # during the walk (torch 2.11 frees unreferenced ones, and their ids come back).
    seen: dict[int, Any] = {}
    todo = [t.grad_fn for t in outputs]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


def _differentiable(result: Any) -> list[torch.Tensor]:
    return [
        t
        for _, t in tensor_leaves(result, "result")
        if t.grad_fn is not None and (t.is_floating_point() or t.is_complex())
    ]


_version_warned = False


def _check_version(version: str) -> tuple[str, str | None]:
    """The checked release whose behaviours apply to torch ``version``, and a note (and,
    once per process, a warning) when ``version`` is not of a release in
    :data:`CHECKED_TORCH`."""
    global _version_warned
    release = nearest_checked(version).release
    if "{}.{}".format(*release_of(version)) in CHECKED_TORCH:
        return release, None
    note = (
        f"torch {version} is running; the table was checked against torch "
        f"{' and '.join(CHECKED_TORCH)}: the behaviours of {release} are used, with the "
        "changes the table knows of; ops that became deterministic or lost their "
        "deterministic kernel in between are not accounted for"
    )
    if not _version_warned:
        _version_warned = True
        warnings.warn(note, UncheckedTorchWarning, stacklevel=3)
    return release, note


def _env_value(name: str) -> str:
    value = os.environ.get(name)
    return "unset" if value is None else short_repr(value)


def audit_nondeterminism(
    fn: Callable[..., Any],
    /,
    *args: Any,
    backward: bool = True,
    warn_only: bool = False,
    seed: int = 0,
    reset: Iterable[Any] = (),
    **kwargs: Any,
) -> AuditReport:
    """Run ``fn(*args, **kwargs)`` once and list the op calls that are nondeterministic on
    CUDA, or have no deterministic CUDA kernel.

    ``fn`` runs where its tensors are (a CPU is enough: the aten ops are the
    same; see the package's docstring for why not the meta device) under a
    dispatch mode that matches every op call against a table checked against
    torch 2.11 and 2.13 (a warning, once, on another release).  Each finding
    names the op, the module that called it, the user's ``file:line``, the
    phase, and what ``torch.use_deterministic_algorithms(True,
    warn_only=warn_only)`` would do on CUDA with the running torch:
    ``"raise"``, ``"warn"``, ``"deterministic"`` (switch to a deterministic
    kernel) or ``"none"`` (nothing: it stays nondeterministic, silently).
    Calls at one place are counted, not repeated.
    Memory from ``torch.empty`` read before anything wrote it is listed too.

    With ``backward=True``, autograd's backward ops are audited: those ``fn``
    runs itself (``loss.backward()``), and, when ``fn`` runs none, those of a
    backward pass the audit runs from ``fn``'s result (every floating-point
    tensor in it that has a gradient function, with gradients of ones) through
    ``torch.autograd.grad``, so no ``.grad`` changes.  A backward op is
    attributed to the module and line of the forward call that created it.
    With ``backward=False``, backward ops are left out and none is run.

    Nothing global changes: the run is a ``deterministic(seed, flags=False)``
    block (every RNG seeded, then restored with every flag; deterministic
    algorithms are off inside it, or CPU ops such as ``put_`` would raise),
    and modules and optimizers passed as ``fn`` or as direct arguments, and
    the objects in ``reset``, are put back as they were.

    Example:
        >>> import torch
        >>> def step(x, index):
        ...     return torch.zeros(3).index_add_(0, index, x)
        >>> report = audit_nondeterminism(step, torch.ones(4), torch.tensor([0, 0, 1, 2]))
        >>> [(f.op, f.behaviour) for f in report.findings]
        [('aten.index_add_.default', 'deterministic')]
    """
    block = deterministic(seed, flags=False)
    objects, saved = prepare_runs(fn, args, kwargs, reset, backward=backward, warn_only=warn_only)
    version = str(torch.__version__)
    checked_against, version_note = _check_version(version)
    notes = [] if version_note is None else [version_note]
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]
    modules = Modules(roots)
    auditor = Auditor(modules, backward=backward, warn_only=warn_only, version=version)
    functions = Functions(auditor, watched_functions())
    ran_backward = False
    try:
        with block:
            if torch.are_deterministic_algorithms_enabled():
                # The audit watches what ops do without deterministic mode; the block
                # puts the caller's setting back.
                torch.use_deterministic_algorithms(False)
            handles = [
                _nn_module.register_module_forward_pre_hook(modules.pre_hook),
                _nn_module.register_module_forward_hook(modules.post_hook),
            ]
            try:
                with functions, auditor.mode:
                    result = call_and_consume(fn, args, kwargs)
                    ran_backward = auditor.backward_calls > 0
                    if backward and not ran_backward:
                        outputs = _differentiable(result)
                        leaves = _graph_leaves(outputs)
                        if leaves:
                            # Gradients are returned, not accumulated: no .grad changes.
                            torch.autograd.grad(
                                outputs,
                                leaves,
                                [torch.ones_like(t) for t in outputs],
                                allow_unused=True,
                            )
                            ran_backward = True
            finally:
                for handle in handles:
                    handle.remove()
    finally:
        saved.load()
    if backward and not ran_backward:
        notes.append(
            "fn ran no backward pass and returned no floating-point tensor with a gradient "
            "function: no backward op was audited"
        )
    if (
        auditor.cublas
        and release_of(version) < release_of(CUBLAS_CONFIG_CHECKED_BEFORE)
        and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_VALID
    ):
        notes.append(
            "fn runs cuBLAS matmuls: on CUDA, use_deterministic_algorithms(True) raises at the "
            f"first one unless CUBLAS_WORKSPACE_CONFIG is {' or '.join(CUBLAS_VALID)} "
            "(deterministic() blocks set it); here it is " + _env_value("CUBLAS_WORKSPACE_CONFIG")
        )
    if modules.recurrent:
        notes.append(
            f"fn runs {', '.join(sorted(modules.recurrent))}: on CUDA, recurrent layers run "
            "cuDNN's RNN ops, which the audit cannot see (the CPU runs other ones); torch "
            "documents them as deterministic on CUDA only with CUBLAS_WORKSPACE_CONFIG set "
            f"({' or '.join(CUBLAS_VALID)}); here it is " + _env_value("CUBLAS_WORKSPACE_CONFIG")
        )
    return AuditReport(
        tuple(auditor.findings.values()),
        auditor.calls,
        backward and ran_backward,
        warn_only,
        version,
        checked_against,
        tuple(notes),
    )
