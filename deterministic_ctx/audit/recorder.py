"""``audit_nondeterminism``: the ops of a run that are nondeterministic on CUDA, found on a CPU.

Which ops of a model are nondeterministic on a GPU?  Today one learns it from
a ``RuntimeError`` under ``torch.use_deterministic_algorithms(True)`` on the
GPU, one op at a time, or from a list in torch's docs.  The audit runs the
function once, wherever its tensors are (a CPU is enough), under a
``TorchDispatchMode`` that sees every aten op call, and matches each call
against a table of the cases (:mod:`.table`, checked against
torch 2.11 on a GPU and 2.13 from source; where torch changed a behaviour, the
running release's is used): the op, the condition on its arguments
(``index_put_(accumulate=False)``, ``scatter_reduce(reduce="prod")``,
``EmbeddingBag(mode="max")`` backward, ...) and what deterministic mode does
on CUDA: raise, warn, switch to a deterministic kernel, or nothing.  Each finding names
the module that made the call and the user's ``file:line`` (frames of torch,
of this package and of the standard library are skipped); an op of autograd's
backward pass is attributed to the forward call that created it.

Why the CPU and not the meta device: ``fn`` builds or holds its own tensors,
which the audit cannot move; data-dependent ops (``nonzero``, ``.item()``,
Python control flow on values) do not run on meta tensors; and for most ops
the CPU runs the same aten ops at the level the audit watches.  Where the CPU
runs another kernel than CUDA would (attention with dropout), the table says
so.  Recurrent layers are the exception the table cannot cover: on CUDA,
``nn.RNN``/``nn.LSTM``/``nn.GRU`` run cuDNN's RNN ops, on the CPU other ones
(``mkldnn_rnn_layer``), so the audit never sees the CUDA ops; the report adds
a note when such a module ran (torch documents them as deterministic on CUDA
only with ``CUBLAS_WORKSPACE_CONFIG`` set).

Example:
    >>> import torch
    >>> from deterministic_ctx.audit import audit_nondeterminism
    >>> up = torch.nn.Upsample(scale_factor=2, mode="bicubic")
    >>> report = audit_nondeterminism(up, torch.randn(1, 1, 4, 4, requires_grad=True))
    >>> [(f.op, f.phase, f.behaviour) for f in report.findings]
    [('aten.upsample_bicubic2d_backward.default', 'backward', 'raise')]
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import CodeType, FrameType
from typing import Any

import torch
from torch.nn.modules import module as _nn_module
from torch.overrides import TorchFunctionMode

from ..compare import short_repr, tensor_leaves
from ..context import deterministic
from ..internal import CUBLAS_VALID
from ..ops import QuietDispatchMode, is_library_file
from ..rerun import SavedState, call_and_consume, check_fn, objects_to_reset
from .table import (
    CHECKED_TORCH,
    CUBLAS_CONFIG_CHECKED_BEFORE,
    TABLE,
    Behaviour,
    OpCall,
    OpEntry,
    entries_for,
    nearest_checked,
    release_of,
    uninitialized_entry,
)

__all__ = ["AuditFinding", "AuditReport", "audit_nondeterminism"]


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
                lines.append(f"  {n}. {f.op} ({f.phase}, {calls}) in {f.where}")
                condition = f"when {f.condition}: " if f.condition else ""
                lines.append(f"     {condition}under {mode} {_VERBS[f.behaviour]}.")
                first = explained.setdefault((f.entry, f.note), n)
                lines.append(f"     {f.note}" if first == n else f"     (See {first}.)")
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)


# --- where a call comes from ------------------------------------------------------------------

#: Top-level modules of this project: library frames wherever they are installed (the
#: pytest plugin is a top-level module beside the package).
_OWN = frozenset({"deterministic_ctx", "_deterministic_ctx_pytest"})


@dataclasses.dataclass(frozen=True)
class _Site:
    """Where an op call was made: the user's line, the module, torch's Python callers."""

    location: str
    module: str | None
    module_type: str | None
    callers: frozenset[str]


class _Frames:
    """Names the user's line of a call: each code object is classified once per audit
    (user code, a torch function, or another library frame), so a stack walk is a few
    dictionary look-ups per frame."""

    def __init__(self) -> None:
        self._kinds: dict[CodeType, str | None] = {}
        self._paths: dict[str, str] = {}
        self._cwd = os.getcwd() + os.sep

    @staticmethod
    def _classify(frame: FrameType) -> str | None:
        """``None`` for a user frame; the qualified name for a torch frame
        (``torch.nn.functional.pad``); ``""`` for another library frame.

        Library code is told by file path, the rule :mod:`.ops` uses: a module name
        says too little (``sys.stdlib_module_names`` has ``test``, ``code`` and
        ``types``, common names of a user's own modules)."""
        module = str(frame.f_globals.get("__name__", ""))
        top = module.partition(".")[0]
        code = frame.f_code
        if top == "torch":
            return f"{module}.{getattr(code, 'co_qualname', code.co_name)}"  # Python 3.11+
        if top in _OWN or is_library_file(code.co_filename):
            return ""
        return None

    def _path(self, filename: str) -> str:
        path = self._paths.get(filename)
        if path is None:
            inside = filename.startswith(self._cwd)
            path = self._paths[filename] = filename[len(self._cwd) :] if inside else filename
        return path

    def user_frame(self, frame: FrameType | None) -> tuple[str, frozenset[str]]:
        """The first frame outside torch, this package and the standard library, as
        ``file:line``, and the torch functions on the way (``torch.nn.functional.pad``)."""
        callers: list[str] = []
        kinds = self._kinds
        while frame is not None:
            code = frame.f_code
            try:
                kind = kinds[code]
            except KeyError:
                kind = kinds[code] = self._classify(frame)
            if kind is None:
                return f"{self._path(code.co_filename)}:{frame.f_lineno}", frozenset(callers)
            if kind:
                callers.append(kind)
            frame = frame.f_back
        return "<unknown>", frozenset(callers)


#: Modules of the machinery between an op's caller and ``__torch_dispatch__``.
_MACHINERY = ("torch._dynamo", "torch._compile", "torch._ops", "torch.utils._python_dispatch")


def _called_outside_torch(frame: FrameType | None) -> bool:
    """Whether the op was called by code outside torch (the user's, or an example of the
    table), rather than by torch's Python code.

    Memory that torch creates, torch fills, sometimes in C++ through a data pointer,
    which the dispatch mode cannot see (``F.ctc_loss`` builds a tensor of lengths so):
    only memory the user's code creates is watched for reads before writes.
    """
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not name.startswith(_MACHINERY):
            return name.partition(".")[0] != "torch"
        frame = frame.f_back
    return True


class _Modules:
    """Which module is running, from global module hooks: names within their root models.

    Roots are the modules passed to the audit, then any module whose name is
    not known when it is first called (a model built inside ``fn``): its
    pre-hook runs before its children's, so they are named relative to it.
    """

    def __init__(self, roots: Iterable[torch.nn.Module]) -> None:
        self._names: dict[int, tuple[str, str]] = {}
        self._keep: list[torch.nn.Module] = []  # keeps the ids valid while the audit runs
        self._stack: list[tuple[torch.nn.Module, str, str]] = []
        self._thread = threading.get_ident()
        #: Class names of the recurrent modules that ran (see the module's docstring).
        self.recurrent: set[str] = set()
        for root in roots:
            self._name(root)

    def _name(self, module: torch.nn.Module) -> tuple[str, str]:
        found = self._names.get(id(module))
        if found is None:
            self._keep.append(module)
            for name, sub in module.named_modules():
                self._names.setdefault(id(sub), (name, type(sub).__qualname__))
            found = self._names[id(module)]
        return found

    def current(self) -> tuple[str | None, str | None]:
        if not self._stack:
            return None, None
        _, name, kind = self._stack[-1]
        return name, kind

    def pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() == self._thread:
            self._stack.append((module, *self._name(module)))
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


# --- the dispatch mode --------------------------------------------------------------------------

#: The current autograd node while autograd's backward runs (torch >= 2.1 has it).
_current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)

#: A node's ``_sequence_nr()`` when it has none (``AccumulateGrad``): UINT64_MAX.
_NO_SEQUENCE_NR = 2**64 - 1


def _node_key(node: Any) -> tuple[str, int] | None:
    """A key that names an autograd node for its whole life; ``None`` for a node without one.

    Not ``hash(node)``: once no reference to a C++ node's Python object is left, torch may
    free it and make a new one at the next access (torch 2.11 does), and the freed
    object's id, which is its hash, comes back for another node.  A node's sequence
    number is set when the node is made and is unique among the nodes its thread made;
    with the class name it names the node across Python objects.
    """
    sequence_nr = getattr(node, "_sequence_nr", None)
    if sequence_nr is None:
        return None
    number = int(sequence_nr())
    return None if number == _NO_SEQUENCE_NR else (type(node).__name__, number)


#: Ops that run on cuBLAS on CUDA: before torch 2.10 they raise in deterministic mode
#: without a valid ``CUBLAS_WORKSPACE_CONFIG``.
_CUBLAS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation"}
)

_UNINITIALIZED = uninitialized_entry()
_CREATE = frozenset(_UNINITIALIZED.ops) - {"resize_", "resize_as_"}
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


def _arguments(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The call's arguments by their schema names, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _tensors(*groups: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among op arguments or results: at the top level or in a list or tuple
    (``Tensor[]``, ``Tensor?[]``, several results), all an aten schema has."""
    for group in groups:
        for value in group:
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from (v for v in value if isinstance(v, torch.Tensor))


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # sparse, nested: no plain storage
        return None


def _reads_values(func: Any, name: str) -> bool:
    """Whether ``func`` reads the values of its tensor arguments (views and metadata
    ops do not)."""
    if name in _METADATA or name in _CREATE or name.endswith("_like") or name.startswith("new_"):
        return False
    # In-place views (t_, transpose_, squeeze_, as_strided_, ...) change only the
    # tensor's metadata; their ``is_view`` is False, their tag says it.
    if torch.Tag.inplace_view in getattr(func, "tags", ()):
        return False
    return not getattr(func, "is_view", False)


class _Auditor(QuietDispatchMode):
    """Sees every aten op call of the run and keeps what matches the table
    (never importing torch._dynamo: see :class:`~deterministic_ctx.ops.QuietDispatchMode`)."""

    def __init__(self, modules: _Modules, *, backward: bool, warn_only: bool, version: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.modules = modules
        self.frames = _Frames()
        self.backward = backward
        self.warn_only = warn_only
        self.version = version
        self.calls = 0
        self.backward_calls = 0
        self.cublas = False
        self.findings: dict[tuple[Any, ...], AuditFinding] = {}
        # Outputs of the last forward op that needed gradients: their autograd nodes
        # exist only once the op has returned, so they are looked up at the next call.
        self._pending: list[tuple[weakref.ref[torch.Tensor], _Site]] = []
        # Autograd node (see _node_key) -> where its forward op was called: a backward op
        # is attributed to that call.
        self._nodes: dict[tuple[str, int], _Site] = {}
        # Storage -> (storage, where and by which op it was created), while nothing wrote it.
        self._uninitialized: dict[int, tuple[Any, _Site, str]] = {}
        # Per watched function call in progress: the aten ops it dispatched.
        self.watching: list[set[str]] = []

    # Where calls come from.

    def site(self, frame: FrameType | None) -> _Site:
        location, callers = self.frames.user_frame(frame)
        module, module_type = self.modules.current()
        return _Site(location, module, module_type, callers)

    def _backward_site(self, node: Any, frame: FrameType | None) -> _Site:
        key = _node_key(node)
        known = None if key is None else self._nodes.get(key)
        if known is not None:
            return known
        # A node whose creation was not seen (a custom autograd.Function): the user's
        # frame now is the best there is, e.g. a line of its backward().
        location, callers = self.frames.user_frame(frame)
        return _Site(location, None, None, callers)

    def resolve(self) -> None:
        """Attribute the autograd nodes of the last forward op's outputs to its call."""
        for ref, site in self._pending:
            t = ref()
            key = None if t is None or t.grad_fn is None else _node_key(t.grad_fn)
            if key is not None:
                self._nodes[key] = site
        self._pending.clear()

    # Findings.

    def add(self, entry: OpEntry, op: str, site: _Site, phase: str) -> None:
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
        )

    def _dispatch(self, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        self.calls += 1
        if self._pending:
            self.resolve()
        name = func.overloadpacket.__name__
        node = _current_node()
        frame = _caller(sys._getframe(1))
        site: _Site | None = None
        if node is not None:
            self.backward_calls += 1
        for watch in self.watching:
            watch.add(name)
        if name in _CUBLAS:
            self.cublas = True

        if node is None or self.backward:
            entries = entries_for(name)
            if entries:
                site = self.site(frame) if node is None else self._backward_site(node, frame)
                call = OpCall(str(func), name, _arguments(func, args, kwargs), site.callers)
                for entry in entries:
                    if entry.kind == "op" and entry.matches(call):
                        self.add(entry, call.op, site, "forward" if node is None else "backward")
                        break
        if self._uninitialized:
            self._check_reads(func, name, args, kwargs, frame)
        grown = None
        if name in _GROW and args and isinstance(args[0], torch.Tensor):
            grown = (args[0], args[0].untyped_storage().nbytes())

        out = func(*args, **kwargs)

        if (
            name in _CREATE
            or (grown is not None and grown[0].untyped_storage().nbytes() > grown[1])
        ) and _called_outside_torch(frame):
            created = grown[0] if grown is not None else out
            if isinstance(created, torch.Tensor) and created.numel() > 0:
                key = _storage_key(created)
                if key is not None:
                    if site is None:
                        site = self.site(frame)
                    self._uninitialized[key] = (created.untyped_storage(), site, str(func))
        # Forward ops whose outputs get an autograd node: remember where they were called.
        if (
            node is None
            and torch.is_grad_enabled()
            and any(t.requires_grad for t in _tensors(args, kwargs.values()))
        ):
            if site is None:
                site = self.site(frame)
            self._pending += [(weakref.ref(t), site) for t in _tensors((out,))]
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
        if not _reads_values(func, name):
            return
        values = _arguments(func, args, kwargs)
        # put_/index_put_ with accumulate=True, scatter_ with reduce= read what they write to.
        write_only = (
            name in _WRITE_ONLY and not values.get("accumulate") and values.get("reduce") is None
        )
        schema_args = func._schema.arguments
        for arg in schema_args:
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors((values.get(arg.name),)):
                key = _storage_key(t)
                created = None if key is None else self._uninitialized.pop(key, None)
                if created is None or (written and (write_only or arg.is_out)):
                    continue
                _, site, op = created
                reader = self.site(frame)
                note = f"{_UNINITIALIZED.note} Read by {func} at {reader.location}."
                entry = dataclasses.replace(_UNINITIALIZED, note=note)
                self.add(entry, op, site, "forward")


#: Frames of this module and of ops.py's QuietDispatchMode between an op's caller
#: and the audit's bookkeeping.
_DISPATCH_FRAMES = frozenset({"__torch_dispatch__", "_hand_over", "_dispatch"})
_DISPATCH_MODULES = frozenset({__name__, QuietDispatchMode.__module__})


def _caller(frame: FrameType | None) -> FrameType | None:
    """The first frame outside the audit's own dispatch frames (and dynamo's disabling
    wrapper, when it is in between)."""
    while frame is not None and (
        (
            frame.f_globals.get("__name__") in _DISPATCH_MODULES
            and frame.f_code.co_name in _DISPATCH_FRAMES
        )
        or str(frame.f_globals.get("__name__", "")).startswith("torch._dynamo")
    ):
        frame = frame.f_back
    return frame


class _Functions(TorchFunctionMode):
    """Watches calls of the torch functions the table names (``kind="function"``)."""

    def __init__(self, auditor: _Auditor, entries: Mapping[Any, tuple[str, OpEntry]]) -> None:
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


def _watched_functions() -> dict[Any, tuple[str, OpEntry]]:
    """The table's torch functions, by the function object that torch dispatches with."""
    found: dict[Any, tuple[str, OpEntry]] = {}
    for entry in TABLE:
        if entry.kind != "function":
            continue
        for qualname in entry.ops:
            module_name, _, attribute = qualname.rpartition(".")
            module = sys.modules.get(module_name)
            function = getattr(module, attribute, None) if module is not None else None
            if function is not None:
                found[function] = (qualname, entry)
    return found


# --- the audit -----------------------------------------------------------------------------------


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
        warnings.warn(note, stacklevel=3)
    return release, note


def _env_value(name: str) -> str:
    value = os.environ.get(name)
    return "unset" if value is None else short_repr(value)


def _check_flag(value: object, name: str) -> bool:
    if type(value) is not bool:
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.80}")
    return value


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
    same; see the module's docstring for why not the meta device) under a
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
    check_fn(fn)
    backward = _check_flag(backward, "backward")
    warn_only = _check_flag(warn_only, "warn_only")
    objects = objects_to_reset(fn, args, kwargs, reset)
    version = str(torch.__version__)
    checked_against, version_note = _check_version(version)
    notes = [] if version_note is None else [version_note]
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]
    modules = _Modules(roots)
    auditor = _Auditor(modules, backward=backward, warn_only=warn_only, version=version)
    functions = _Functions(auditor, _watched_functions())
    ran_backward = False
    saved = SavedState(objects)
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
                with functions, auditor:
                    result = call_and_consume(fn, args, kwargs)
                    auditor.resolve()
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
