"""The audit's dispatch mode: sees every aten op call of the run (and calls of the torch
functions the table names) and keeps the ones that match the table, with where they came
from (the module that made the call, from global module hooks, and the user's ``file:line``
and the torch functions on the way, from :func:`~deterministic_ctx.verify.ops.user_frame`);
memory read before anything wrote it is found here too."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._torch.flags import current_autograd_node
from .._torch.internals import TORCH_MACHINERY
from ..internal import is_exempted
from ..verify.ops import (
    NodeOrigins,
    QuietDispatchMode,
    op_arguments,
    op_schema,
    op_tensors,
    user_frame,
)
from ..verify.record import ModuleNames
from .findings import AuditFinding
from .model import OpCall, OpEntry
from .table import entries_for, table, uninitialized_entry

__all__ = ["Auditor", "Functions", "Modules", "Site", "watched_functions"]

#: Ops that run on cuBLAS on CUDA: before torch 2.10 they raise in deterministic mode
#: without a valid ``CUBLAS_WORKSPACE_CONFIG``.
_CUBLAS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"}
)

_GROW = frozenset({"resize_", "resize_as_"})
#: In-place ops that write their ``self`` without reading it: a write, not a read, of
#: uninitialized memory (partial writes such as index_put_ count as writes: the audit
#: misses a later read of the part they did not write, rather than report writes).
_WRITE_ONLY = frozenset(
    {
        "fill_",
        "zero_",
        "copy_",
        "uniform_",
        "normal_",
        "bernoulli_",
        "random_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "index_put_",
        "_index_put_impl_",
        "index_copy_",
        "index_fill_",
        "masked_fill_",
        "masked_scatter_",
        "scatter_",
        "put_",
        "fill_diagonal_",
        "set_",
    }
)
#: Ops that read only their arguments' metadata, never their values.
_METADATA = frozenset(
    {"lift_fresh", "set_", "resize_", "resize_as_", "is_same_size", "_has_same_storage_numel"}
)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # sparse, nested: no plain storage
        return None


def _reads_values(func: Any, name: str, create: frozenset[str]) -> bool:
    """Whether ``func`` reads the values of its tensor arguments (views and metadata
    ops, and the ops in ``create``, do not)."""
    if name in _METADATA or name in create or name.endswith("_like") or name.startswith("new_"):
        return False
    # In-place views (t_, transpose_, squeeze_, as_strided_, ...) change only the
    # tensor's metadata; their ``is_view`` is False, their tag says it.
    if torch.Tag.inplace_view in getattr(func, "tags", ()):
        return False
    return not getattr(func, "is_view", False)


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an op call was made: the user's line, the module, torch's Python callers."""

    location: str
    module: str | None
    module_type: str | None
    callers: frozenset[str]


def called_outside_torch(frame: FrameType | None) -> bool:
    """Whether the op was called by code outside torch (the user's, or an example of the
    table), rather than by torch's Python code.

    Memory that torch creates, torch fills, sometimes in C++ through a data pointer,
    which the dispatch mode cannot see (``F.ctc_loss`` builds a tensor of lengths so):
    only memory the user's code creates is watched for reads before writes.
    """
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(TORCH_MACHINERY):
            return name.partition(".")[0] != "torch"
        frame = frame.f_back
    return True


class Modules:
    """Which module is running, from global module hooks: names within their root models.

    Roots are the modules passed to the audit, then any module whose name is
    not known when it is first called (see :class:`~deterministic_ctx.verify.record.ModuleNames`).
    """

    def __init__(self, roots: Iterable[torch.nn.Module]) -> None:
        self._names = ModuleNames(roots)
        self._stack: list[tuple[torch.nn.Module, str, str]] = []
        self._thread = threading.get_ident()
        #: Class names of the recurrent modules that ran (see the package's docstring).
        self.recurrent: set[str] = set()

    def current(self) -> tuple[str | None, str | None]:
        if not self._stack:
            return None, None
        _, name, kind = self._stack[-1]
        return name, kind

    def pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() == self._thread:
            _, name, kind = self._names.of(module)
            self._stack.append((module, name, kind))
            if isinstance(module, torch.nn.RNNBase):
                self.recurrent.add(type(module).__qualname__)

    def post_hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        # Calls nest: the last one started ends first (a module that raised and was
        # caught inside fn left its entry: found further down and cut there).
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth][0] is module:
                del self._stack[depth:]
                return


class Auditor:
    """Sees every aten op call of the run through its :attr:`mode` and keeps what
    matches the table."""

    def __init__(self, modules: Modules, *, backward: bool, warn_only: bool, version: str) -> None:
        #: The dispatch mode to enter (it never imports torch._dynamo: see
        #: :class:`~deterministic_ctx.verify.ops.QuietDispatchMode`).
        self.mode = QuietDispatchMode(self._dispatch)
        self.modules = modules
        # User files under the working directory are named relative to it.
        self._cwd = os.getcwd() + os.sep
        self.backward = backward
        self.warn_only = warn_only
        self.version = version
        self.calls = 0
        self.backward_calls = 0
        self.cublas = False
        self.findings: dict[tuple[Any, ...], AuditFinding] = {}
        #: Where the forward op that made each autograd node was called: a backward op is
        #: attributed to that call.
        self.origins = NodeOrigins[Site]()
        # Storage -> (storage, where and by which op it was created), while nothing wrote it.
        self._uninitialized: dict[int, tuple[Any, Site, str]] = {}
        # The table's entry for reads of such memory, and the ops that create it (the table
        # is read at the first audit, not at import).
        self._unwritten = uninitialized_entry()
        self._create = frozenset(self._unwritten.ops) - _GROW
        # Per watched function call in progress: the aten ops it dispatched.
        self.watching: list[set[str]] = []

    # Where calls come from.

    def site(self, frame: FrameType | None, node: Any = None) -> Site:
        """Where a call made from ``frame`` was made: the user's ``file:line`` (frames of
        torch, of this package and of the standard library skipped), the module running,
        and the torch functions on the way (``torch.nn.functional.pad``).  For an op that
        autograd's engine runs for ``node``: where the forward op that made it was called."""
        known = None if node is None else self.origins.of(node)
        if known is not None:
            return known
        found, _, callers = user_frame(frame)
        location = "<unknown>"
        if found is not None:
            location = f"{found.f_code.co_filename.removeprefix(self._cwd)}:{found.f_lineno}"
        # A node whose creation was not seen (a custom autograd.Function): the user's
        # frame now is the best there is, e.g. a line of its backward(), in no module.
        module, module_type = self.modules.current() if node is None else (None, None)
        return Site(location, module, module_type, callers)

    # Findings.

    def add(self, entry: OpEntry, op: str, site: Site, phase: str, exempted: bool = False) -> None:
        key = (entry.key, op, site.location, site.module, phase)
        found = self.findings.get(key)
        if found is not None:
            self.findings[key] = dataclasses.replace(found, count=found.count + 1)
            return
        self.findings[key] = AuditFinding(
            op,
            site.module,
            site.module_type,
            site.location,
            entry.behaviour_under(warn_only=self.warn_only, version=self.version),
            phase,
            entry.note,
            entry.condition,
            entry.key,
            exempted=exempted,
        )

    def _dispatch(
        self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], frame: FrameType | None
    ) -> Any:
        self.calls += 1
        name = func.overloadpacket.__name__
        node = current_autograd_node()
        site: Site | None = None
        if node is not None:
            self.backward_calls += 1
        for watch in self.watching:
            watch.add(name)
        if name in _CUBLAS:
            self.cublas = True

        if node is None or self.backward:
            entries = entries_for(name)
            if entries:
                site = self.site(frame, node)
                call = OpCall(str(func), name, op_arguments(func, args, kwargs), site.callers)
                for entry in entries:
                    if entry.kind == "op" and entry.matches(call):
                        phase = "forward" if node is None else "backward"
                        self.add(entry, call.op, site, phase, is_exempted(func))
                        break
        if self._uninitialized:
            self._check_reads(func, name, args, kwargs, frame)
        grown = None
        if name in _GROW and args and isinstance(args[0], torch.Tensor):
            grown = (args[0], args[0].untyped_storage().nbytes())

        out = func(*args, **kwargs)

        if (
            name in self._create
            or (grown is not None and grown[0].untyped_storage().nbytes() > grown[1])
        ) and called_outside_torch(frame):
            created = grown[0] if grown is not None else out
            if isinstance(created, torch.Tensor) and created.numel() > 0:
                key = _storage_key(created)
                if key is not None:
                    if site is None:
                        site = self.site(frame)
                    self._uninitialized[key] = (created.untyped_storage(), site, str(func))
        # Forward ops whose outputs get an autograd node: remember where they were called.
        if node is None:
            self.origins.made(args, kwargs, out, lambda: site or self.site(frame))
        return out

    def _check_reads(
        self,
        func: Any,
        name: str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        frame: FrameType | None,
    ) -> None:
        """Memory that nothing wrote: written now (forget it), or read (a finding)."""
        if not _reads_values(func, name, self._create):
            return
        values = op_arguments(func, args, kwargs)
        # put_/index_put_ with accumulate=True, scatter_ with reduce= read what they write to.
        write_only = (
            name in _WRITE_ONLY and not values.get("accumulate") and values.get("reduce") is None
        )
        written = op_schema(func)[1]
        for argument, value in values.items():
            for t in op_tensors((value,)):
                key = _storage_key(t)
                created = None if key is None else self._uninitialized.pop(key, None)
                if created is None or (argument in written and (write_only or written[argument])):
                    continue
                _, site, op = created
                reader = self.site(frame)
                note = f"{self._unwritten.note} Read by {func} at {reader.location}."
                entry = dataclasses.replace(self._unwritten, note=note)
                self.add(entry, op, site, "forward")


class Functions(TorchFunctionMode):
    """Watches calls of the torch functions the table names (``kind="function"``)."""

    def __init__(self, auditor: Auditor, entries: Mapping[Any, tuple[str, OpEntry]]) -> None:
        super().__init__()
        self.auditor = auditor
        self.entries = entries

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        try:
            watched = self.entries.get(func)
        except TypeError:  # an unhashable callable: not one of torch's functions
            watched = None
        if watched is None:
            return func(*args, **kwargs)
        qualname, entry = watched
        auditor = self.auditor
        frame = sys._getframe(1)
        dispatched: set[str] = set()
        auditor.watching.append(dispatched)
        try:
            out = func(*args, **kwargs)
        finally:
            auditor.watching.remove(dispatched)
        if entry.phase == "backward" and not (auditor.backward and torch.is_grad_enabled()):
            return out
        if dispatched.isdisjoint(entry.unless_dispatched):
            arguments = _bind(func, entry, args, kwargs)
            site = auditor.site(frame)
            if entry.matches(OpCall(qualname, qualname, arguments, site.callers)):
                auditor.add(entry, qualname, site, entry.phase)
        return out


def _bind(
    func: Any, entry: OpEntry, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """A watched function's arguments by name, defaults filled in where known."""
    if entry.parameters:
        return {**dict(zip(entry.parameters, args, strict=False)), **kwargs}
    try:
        bound = inspect.signature(func).bind(*args, **kwargs)
    except (TypeError, ValueError):  # no signature, or a call the function would refuse
        return dict(kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def watched_functions() -> dict[Any, tuple[str, OpEntry]]:
    """The table's torch functions, by the function object that torch dispatches with."""
    found: dict[Any, tuple[str, OpEntry]] = {}
    for entry in table():
        if entry.kind != "function":
            continue
        for qualname in entry.ops:
            module_name, _, attribute = qualname.rpartition(".")
            module = sys.modules.get(module_name)
            function = getattr(module, attribute, None) if module is not None else None
            if function is not None:
                found[function] = (qualname, entry)
    return found
