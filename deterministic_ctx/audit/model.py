"""What the op table is made of: :class:`OpEntry` (one case), :class:`OpCall` (a call as an
entry's condition sees it), the behaviours, and the torch releases the table was checked
against (:data:`CHECKED_TORCH`, :data:`CHECKS`).  The entries themselves are data, read by
:mod:`.table`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

from .._errors import PUBLIC_MODULE, DeterministicCtxWarning
from .._torch import release_of

__all__ = [
    "CHECKED_TORCH",
    "CHECKS",
    "CUBLAS_CONFIG_CHECKED_BEFORE",
    "Behaviour",
    "Check",
    "How",
    "Kind",
    "OpCall",
    "OpEntry",
    "Phase",
    "UncheckedTorchWarning",
    "nearest_checked",
]

#: The torch releases (major.minor) the table was checked against, oldest first.
CHECKED_TORCH: tuple[str, ...] = ("2.11", "2.13")


class UncheckedTorchWarning(DeterministicCtxWarning, UserWarning):
    """The running torch is of a release the audit's op table was not checked against.

    :func:`~deterministic_ctx.audit_nondeterminism` then applies the behaviours of the
    nearest checked release with the changes the table knows of, says so in the report's
    ``notes``, and issues this warning once per process.

    Example:
        >>> from deterministic_ctx import DeterministicCtxWarning, UncheckedTorchWarning
        >>> issubclass(UncheckedTorchWarning, DeterministicCtxWarning)
        True
        >>> issubclass(UncheckedTorchWarning, UserWarning)
        True
    """

    __module__ = PUBLIC_MODULE


#: Up to (not including) this torch release, cuBLAS matmuls raise under deterministic
#: mode unless ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8`` or ``:16:8``; torch 2.10 dropped
#: the check (pytorch#161749), and neither 2.11.0 nor 2.13.0 has its message.
CUBLAS_CONFIG_CHECKED_BEFORE = "2.10"

#: What ``torch.use_deterministic_algorithms(True)`` does on CUDA: ``"raise"`` a
#: ``RuntimeError`` (no deterministic kernel), ``"warn"`` and keep the
#: nondeterministic kernel, switch to a ``"deterministic"`` kernel, or ``"none"``:
#: nothing, the kernel stays nondeterministic without an error or a warning.
Behaviour = Literal["raise", "warn", "deterministic", "none"]
Phase = Literal["forward", "backward"]
#: How a release's behaviours were checked: ``"observed"`` (every example run on a real
#: GPU) or ``"source"`` (read from torch's code, docs and binaries; not run).
How = Literal["observed", "source"]
#: ``"op"``: matched per aten op call; ``"function"``: matched per call of a torch
#: Python function (``ops`` are then qualified function names); ``"uninitialized"``:
#: ops that create uninitialized memory, reported when it is read before written.
Kind = Literal["op", "function", "uninitialized"]


@dataclasses.dataclass(frozen=True)
class Check:
    """How the table was checked against one torch release.

    Example:
        >>> CHECKS[0].release, CHECKS[0].how
        ('2.11', 'observed')
    """

    release: str
    how: How
    what: str

    def describe(self) -> str:
        """``"2.11 (observed on a GPU)"``-style words for reports."""
        how = "observed on a GPU" if self.how == "observed" else "read from source"
        return f"{self.release} ({how})"


#: One per release of :data:`CHECKED_TORCH`, in the same order.
CHECKS: tuple[Check, ...] = (
    Check(
        "2.11",
        "observed",
        "every entry's example run under use_deterministic_algorithms(True) and (True, "
        "warn_only=True) with torch 2.11.0+cu130 (CUDA 13.0, Python 3.12) on an NVIDIA H200, "
        "2026-11-23",
    ),
    Check(
        "2.13",
        "source",
        "torch 2.13.0 (git cf30153c): torch/nn/functional.py, torch/_decomp, the "
        "use_deterministic_algorithms docstring, and the alert names and kernels in "
        "libtorch_cuda.so of the 2.13.0+cu130 wheel, compared with 2.11.0's; not run on a GPU",
    ),
)


def nearest_checked(version: str) -> Check:
    """The check of ``version``'s release, or else of the newest checked release before it
    (the oldest one for a release older than all of them).

    Example:
        >>> [nearest_checked(v).release for v in ("2.11.0", "2.12.1", "2.14.0", "2.9.1")]
        ['2.11', '2.11', '2.13', '2.11']
    """
    running = release_of(version)
    earlier = [c for c in CHECKS if release_of(c.release) <= running]
    return earlier[-1] if earlier else CHECKS[0]


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One op call as an entry's condition sees it.

    ``op`` is the overload's name (``"aten.index_put_.default"``), ``name`` its
    overload packet's (``"index_put_"``), ``arguments`` the call's arguments by
    their schema names (defaults filled in), ``callers`` the torch Python
    functions on the stack when it was called (for a backward op: when its
    forward op was called), e.g. ``"torch.nn.functional.interpolate"``.

    Example:
        >>> call = OpCall("aten.put_.default", "put_", {"accumulate": True})
        >>> call["accumulate"], call.get("missing")
        (True, None)
    """

    op: str
    name: str
    arguments: Mapping[str, Any]
    callers: frozenset[str] = frozenset()

    def __getitem__(self, name: str) -> Any:
        return self.arguments[name]

    def get(self, name: str, default: Any = None) -> Any:
        """The argument called ``name``, or ``default`` when the op has none."""
        return self.arguments.get(name, default)


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """One case of the table: which ops, when, and what deterministic mode does.

    Attributes:
        key: a short unique name, e.g. ``"put-accumulate"``.
        ops: aten overload packet names (``kind="op"``), or qualified function
            names (``kind="function"``).
        behaviour: under ``use_deterministic_algorithms(True)``, on the newest release
            of :data:`CHECKED_TORCH` and on any release that ``earlier`` does not cover.
        phase: where the op normally runs (``"backward"``: in autograd's
            backward pass, e.g. ``upsample_bilinear2d_backward``).
        note: why it is nondeterministic, and what to do.
        condition: the condition in words (``""``: always).
        when: the condition as a predicate (``None``: always); in the data file, the
            name of one of :data:`~.conditions.CONDITIONS`.
        warn_only_behaviour: under ``use_deterministic_algorithms(True,
            warn_only=True)``; ``None`` means ``"warn"`` where ``behaviour`` is
            ``"raise"`` and ``behaviour`` otherwise.
        kind: see :data:`Kind`.
        parameters: for ``kind="function"``, the function's parameter names in
            order, for torch's C functions, which have no signature to bind
            arguments with (``()``: bound with the Python function's signature).
        unless_dispatched: for ``kind="function"``, aten ops (packet names)
            whose dispatch during the call means another entry covers it.
        earlier: where torch changed the behaviour: ``(release, behaviour)`` pairs,
            oldest first, each the behaviour on torch releases before ``release``
            (``(("2.13", "raise"),)``: raises before 2.13, ``behaviour`` from then on).
        observed: the releases of :data:`CHECKED_TORCH` on which the example ran on a
            real GPU and did what the table says; on the others the behaviour was read
            from torch's source (see :data:`CHECKS`).

    Example:
        >>> from deterministic_ctx.audit.table import entries_for
        >>> entry = entries_for("put_")[0]
        >>> entry.matches(OpCall("aten.put_.default", "put_", {"accumulate": False}))
        True
        >>> entry.behaviour_under(warn_only=True)
        'warn'
        >>> entry.observed
        ('2.11',)
    """

    key: str
    ops: tuple[str, ...]
    behaviour: Behaviour
    phase: Phase
    note: str
    condition: str = ""
    when: Callable[[OpCall], bool] | None = None
    warn_only_behaviour: Behaviour | None = None
    kind: Kind = "op"
    parameters: tuple[str, ...] = ()
    unless_dispatched: tuple[str, ...] = ()
    earlier: tuple[tuple[str, Behaviour], ...] = ()
    observed: tuple[str, ...] = ("2.11",)

    def matches(self, call: OpCall) -> bool:
        """Whether this entry covers ``call``."""
        return call.name in self.ops and (self.when is None or bool(self.when(call)))

    def behaviour_on(self, version: str | None = None) -> Behaviour:
        """What ``use_deterministic_algorithms(True)`` does on torch ``version`` (a
        ``torch.__version__`` string; ``None``: the newest checked release).

        Example:
            >>> from deterministic_ctx.audit.table import entries_for
            >>> entries_for("cumsum")[0].behaviour_on("2.11.0+cu130")
            'deterministic'
        """
        if version is not None:
            running = release_of(version)
            for release, behaviour in self.earlier:
                if running < release_of(release):
                    return behaviour
        return self.behaviour

    def behaviour_under(self, *, warn_only: bool, version: str | None = None) -> Behaviour:
        """What ``use_deterministic_algorithms(True, warn_only=warn_only)`` does on torch
        ``version`` (``None``: the newest checked release)."""
        behaviour = self.behaviour_on(version)
        if not warn_only:
            return behaviour
        if self.warn_only_behaviour is not None:
            return self.warn_only_behaviour
        return "warn" if behaviour == "raise" else behaviour
