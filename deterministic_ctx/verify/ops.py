"""Recording aten op calls: the op, the user's line that ran it, fingerprints of what it made.

:func:`~deterministic_ctx.verify.locate.locate_divergence` with ``ops=True`` re-runs
the part of a run where two runs first differ under an :class:`OpRecorder`
and compares the two recordings with :func:`first_op_difference`; traces
record whole runs with it.  The recorder is a ``TorchDispatchMode``: it sees
every aten op call made in its thread (and, through autograd's thread-local
state, the ops that autograd's engine runs for a backward started there)
below autograd, after composite ops were decomposed, exactly as the kernels
receive them.  Per op call it keeps an :class:`OpCall`: the op's name
(``"aten.index_add_.default"``), the ``file:line`` of the innermost frame of
*user* code on the stack (torch's own files, this package's and Python's
standard library are skipped; other installed packages count as user code,
since a model's ``forward`` often lives in one), and exact fingerprints
(:mod:`.fingerprint`) of its outputs, of the arguments it changed in place,
and of each tensor input that no recorded op made (a parameter, a batch, a
tensor made with NumPy), taken before the op runs, at every use (so a change
made behind torch's back to such a tensor, e.g. through a NumPy view, shows at
the next op that reads it).  So the first entry that differs between two
recordings is either an op's result, whose inputs all agreed, or an input
from outside, which says the difference came from elsewhere.  A tensor that a
recorded op made is trusted to hold what that op left in it and is not
fingerprinted again when read: a change to it that bypasses torch (through a
NumPy view or a data pointer) is not seen, and the next op that reads it is
named as if it made the difference.

Fingerprints are computed on the tensors' own devices and kept there until
the recorder exits, then moved to the host in one copy per device, like a
recorded run's (:class:`FingerprintStore`).  Cost: every op call made while
the recorder's mode is on goes through Python (about 20 µs on a CPU), and
every recorded one also has its user frame found and its outputs and
outside inputs fingerprinted (a few small torch ops each): a recorded
training step of a 6-block MLP took about 4 times as long as a plain one on
a busy 2-core CPU.

Example:
    >>> import torch
    >>> from deterministic_ctx.verify.ops import OpRecorder, first_op_difference
    >>> def work(scale):
    ...     return torch.ones(3).mul(scale)
    >>> recordings = []
    >>> for scale in (2.0, 3.0):
    ...     with OpRecorder() as rec:
    ...         _ = work(scale)
    ...     recordings.append(rec.calls)
    >>> [c.op for c in recordings[0]]
    ['aten.ones.default', 'aten.mul.Tensor']
    >>> diff = first_op_difference(*recordings)
    >>> diff.kind, diff.call.op, diff.call.function
    ('values', 'aten.mul.Tensor', 'work')
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import sysconfig
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import CodeType, FrameType, TracebackType
from typing import Any, Generic, TypeVar

import torch

from .._errors import MisuseError
from .._torch.flags import current_autograd_node
from .._torch.internals import (
    AUTOGRAD_ENGINE_ENTRIES,
    DYNAMO,
    UnwrappedDispatchMode,
    current_dispatch_mode,
    dynamo_disable,
    node_sequence_nr,
)
from ..internal import check_bool
from .compare import tensor_leaves
from .fingerprint import FingerprintStore

__all__ = [
    "PHASES",
    "NodeOrigins",
    "OpCall",
    "OpDifference",
    "OpRecorder",
    "QuietDispatchMode",
    "TensorPrint",
    "first_op_difference",
    "op_arguments",
    "op_schema",
    "op_tensors",
    "user_frame",
]

#: Which op calls an :class:`OpRecorder` records: all, those made outside autograd's
#: engine, or those autograd's engine runs (a backward pass).
PHASES = ("any", "forward", "backward")

#: A tensor of an op call while recording: path, shape, dtype and where its fingerprint
#: is (a slot, ``None``, or ``("number", repr)`` for a Python number).
_Leaf = tuple[str, tuple[int, ...], str, Any]

#: What the recorder keeps per op call until it exits: op, ``(location, function)``,
#: autograd node, outputs, inputs from outside.
_Record = tuple[str, tuple[str, str] | None, str | None, list[_Leaf], list[_Leaf]]

#: What a :class:`NodeOrigins` keeps per autograd node.
_Where = TypeVar("_Where")


@dataclasses.dataclass(frozen=True)
class TensorPrint:
    """One tensor (or Python number) of an op call, and its fingerprint.

    ``path`` says which: ``"output"``, ``"output[1]"``, ``"self (changed in
    place)"`` or, for an input no recorded op made, ``"input 'index'"``.
    ``fingerprint`` is the bytes of :func:`~deterministic_ctx.verify.fingerprint.fingerprint`
    (for a number, of its ``repr``), or ``None`` when there is none.  ``dtype``
    is torch's name without ``torch.`` (``"float32"``), or the Python type's
    for a number.

    Example:
        >>> TensorPrint("output", (2, 3), "float32", None).shape
        (2, 3)
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    fingerprint: bytes | None


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One recorded aten op call.

    ``op`` is the overload's name (``"aten.index_add_.default"``); ``index``
    its position in the recording.  ``location`` is ``"file:line"`` of the
    user's code responsible and ``function`` the qualified name of the
    function there (``None`` when no user frame was found).  For ops of a
    forward pass that is the line that called the op (through any number of
    torch functions and modules).  For ops autograd's engine runs, ``node``
    names the autograd node (``"IndexBackward0"``, ``"MyFunctionBackward"``);
    the line is in the node's own code when it is Python (a custom
    ``autograd.Function.backward``), else the forward line that created the
    node when the recorder had ``node_locations=True``, else the line that
    started the backward pass.  ``outputs`` are the results and the
    arguments changed in place; ``inputs`` the tensor inputs no earlier
    recorded op made, fingerprinted before the op ran.

    Example:
        >>> call = OpCall(0, "aten.add.Tensor", "model.py:3", "forward", None, (), ())
        >>> call.described()
        'aten.add.Tensor at model.py:3 (in forward)'
    """

    index: int
    op: str
    location: str | None
    function: str | None
    node: str | None
    outputs: tuple[TensorPrint, ...]
    inputs: tuple[TensorPrint, ...]

    def described(self) -> str:
        """``op at file:line (in function)``, with the autograd node in a backward pass."""
        text = self.op
        if self.location is not None:
            text += f" at {self.location}"
            if self.function:
                text += f" (in {self.function})"
        if self.node is not None:
            text += f", in the backward of {self.node}"
        return text


@dataclasses.dataclass(frozen=True)
class OpDifference:
    """The first difference between two op recordings.

    ``kind`` is ``"values"`` (an output's fingerprint differs: the op's inputs
    agreed, so the op itself made the difference), ``"input"`` (a tensor input
    that no recorded op made differs: the difference came from outside),
    ``"shape"`` (shapes or dtypes of outputs or such inputs differ), ``"op"``
    (another op was called at that point), ``"missing"`` or ``"extra"`` (the
    second recording ends first, or the first one does).  ``call`` is the
    first recording's op call (the second's for ``"extra"``), ``other`` the
    second's when both have one; ``index`` their position; ``what`` which
    tensor (``"output"``, ``"input 'index'"``, or ``""``); ``detail`` one
    sentence.

    Example:
        >>> import torch
        >>> from deterministic_ctx.verify.ops import OpRecorder, first_op_difference
        >>> with OpRecorder() as one:
        ...     _ = torch.ones(2).add(1)
        >>> with OpRecorder() as other:
        ...     _ = torch.ones(2).sub(1)
        >>> diff = first_op_difference(one.calls, other.calls)
        >>> diff.kind, diff.call.op, diff.other.op
        ('op', 'aten.add.Tensor', 'aten.sub.Tensor')
    """

    kind: str
    index: int
    call: OpCall
    other: OpCall | None
    what: str
    detail: str

    @property
    def from_outside(self) -> bool:
        """Whether the difference is a tensor input that no recorded op made (its values,
        shape or dtype), read by :attr:`call`: that op only read it, and what made it
        ran before the recording or outside torch ops.  An op that brings Python or
        NumPy data into torch (``torch.tensor``, ``torch.from_numpy``) is not such a
        reader: it is where the outside data comes in.

        Example:
            >>> a = OpCall(0, "aten.neg.default", None, None, None, (),
            ...            (TensorPrint("input 'self'", (2,), "float32", b"a"),))
            >>> b = dataclasses.replace(
            ...     a, inputs=(TensorPrint("input 'self'", (2,), "float32", b"b"),))
            >>> first_op_difference([a], [b]).from_outside
            True
        """
        return (
            self.kind in ("input", "shape")
            and self.what.startswith("input ")
            and self.call.op not in _FRESH
        )


def first_op_difference(
    a: Sequence[OpCall], b: Sequence[OpCall], *, left: str = "run 1", right: str = "run 2"
) -> OpDifference | None:
    """The first op call where recordings ``a`` and ``b`` differ, or ``None``.

    Per op call in order: the op's name, then its inputs from outside
    (shapes, then fingerprints), then its outputs.  ``left`` and ``right``
    name the recordings in the detail sentence.

    Example:
        >>> import torch
        >>> from deterministic_ctx.verify.ops import OpRecorder, first_op_difference
        >>> recordings = []
        >>> for scale in (2.0, 3.0):
        ...     with OpRecorder() as rec:
        ...         _ = torch.ones(3).mul(scale)
        ...     recordings.append(rec.calls)
        >>> diff = first_op_difference(*recordings)
        >>> diff.kind, diff.index, diff.call.op, diff.what
        ('values', 1, 'aten.mul.Tensor', 'output')
        >>> first_op_difference(recordings[0], recordings[0]) is None
        True
    """
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x.op != y.op:
            detail = f"{left} called {x.described()}, {right} called {y.described()}"
            return OpDifference("op", index, x, y, "", detail)
        for kind in ("input", "values"):
            found = _leaves_difference(kind, index, x, y, left, right)
            if found is not None:
                return found
    index = min(len(a), len(b))
    for kind, longer, this, that in (("missing", a, left, right), ("extra", b, right, left)):
        if len(longer) > index:
            detail = f"{this} called {longer[index].described()}, {that} made no more op calls"
            return OpDifference(kind, index, longer[index], None, "", detail)
    return None


def _leaves_difference(
    kind: str, index: int, x: OpCall, y: OpCall, left: str, right: str
) -> OpDifference | None:
    """Where ``x`` and ``y`` differ in their inputs from outside (``kind="input"``) or
    their outputs (``kind="values"``), if they do."""
    xs, ys = (x.inputs, y.inputs) if kind == "input" else (x.outputs, y.outputs)
    layout = [(p.path, p.shape, p.dtype) for p in xs]
    other = [(p.path, p.shape, p.dtype) for p in ys]
    if layout != other:
        detail = f"{_layout(layout)} ({left}) vs {_layout(other)} ({right})"
        # The first tensor whose layout differs, else the first one only one side has.
        differing = [mine for mine, theirs in zip(layout, other, strict=False) if mine != theirs]
        what = next((path for path, _, _ in differing + layout + other), "")
        return OpDifference("shape", index, x, y, what, f"shapes/dtypes differ: {detail}")
    for mine, theirs in zip(xs, ys, strict=True):
        if mine.fingerprint is None or theirs.fingerprint is None:
            continue
        if mine.fingerprint != theirs.fingerprint:
            if kind == "input" and x.op in _FRESH:
                detail = (
                    "it brings in a tensor made from Python or NumPy data (torch.tensor, "
                    f"torch.from_numpy, torch.as_tensor, ...), and that data differs between "
                    f"{left} and {right}"
                )
            elif kind == "input":
                detail = (
                    f"its {mine.path} differs between {left} and {right}, and no recorded op "
                    "made it: the difference comes from outside the recorded ops (earlier code, "
                    "NumPy or another library, or a change that bypassed torch)"
                )
            else:
                detail = (
                    f"its {mine.path} differs between {left} and {right} while every tensor it "
                    "read agreed: the op made the difference"
                )
            return OpDifference(kind, index, x, y, mine.path, detail)
    return None


#: The ops through which torch hands a tensor made outside any op (from Python or NumPy
#: data) to the dispatch modes.
_FRESH = frozenset({"aten.lift_fresh.default", "aten.lift_fresh_copy.default", "aten.lift.default"})


def _layout(layout: list[tuple[str, tuple[int, ...], str]]) -> str:
    return ", ".join(f"{path} {shape} {dtype}" for path, shape, dtype in layout) or "nothing"


# --- whose code is it ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Directories of library code: ``(packages, standard library)``.

    Torch's package and this one are library code wholly; the standard library is,
    except its ``site-packages`` (a virtual environment's ``platstdlib`` is the
    environment's ``lib/pythonX.Y``, which holds the installed packages).
    """
    packages = {
        os.path.dirname(os.path.realpath(torch.__file__)),
        os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
    }
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths}
    return tuple(p + os.sep for p in packages), tuple(p + os.sep for p in stdlib)


_SITE_DIRS = ("site-packages", "dist-packages")


def _qualname(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+


#: Per code object, classified once: ``None`` for user code; for library code the
#: qualified name of a torch function (``"torch.nn.functional.pad"``), else ``""``.
_KINDS: dict[CodeType, str | None] = {}


def _classify(frame: FrameType) -> str | None:
    """``None`` when ``frame`` runs user code, else what :data:`_KINDS` keeps.

    Library code (see :func:`_library_roots`) is told by the code's file, as a module
    name says too little (``sys.stdlib_module_names`` has ``test``, ``code`` and
    ``types``, common names of a user's own modules); torch's modules by their name.
    """
    module = str(frame.f_globals.get("__name__", ""))
    if module.partition(".")[0] == "torch":
        return f"{module}.{_qualname(frame.f_code)}"
    filename = frame.f_code.co_filename
    if filename.startswith("<"):  # "<frozen importlib._bootstrap>" is; "<string>", "<stdin>" not
        return "" if filename.startswith("<frozen") else None
    path = os.path.realpath(filename)
    packages, stdlib = _library_roots()
    if path.startswith(packages):
        return ""
    for root in stdlib:
        if path.startswith(root):
            return None if path[len(root) :].split(os.sep, 1)[0] in _SITE_DIRS else ""
    return None


def user_frame(frame: FrameType | None) -> tuple[FrameType | None, bool, frozenset[str]]:
    """The innermost frame of user code from ``frame`` outwards (``None`` when there is
    none), whether autograd's engine was entered below it (the op is then not that
    code's own: see :data:`~deterministic_ctx._torch.internals.AUTOGRAD_ENGINE_ENTRIES`), and
    the torch functions on the way (``torch.nn.functional.pad``).

    User code is what :func:`_classify` does not count as library code, nor as
    torch's modules.  Each code object is classified once, so a stack walk is a
    few dictionary look-ups per frame.
    """
    engine = False
    callers: list[str] = []
    kinds = _KINDS
    while frame is not None:
        code = frame.f_code
        try:
            kind = kinds[code]
        except KeyError:
            kind = kinds[code] = _classify(frame)
        if kind is None:
            return frame, engine, frozenset(callers)
        if kind:
            callers.append(kind)
        if code in AUTOGRAD_ENGINE_ENTRIES:
            engine = True
        frame = frame.f_back
    return None, engine, frozenset(callers)


# --- where autograd nodes were made --------------------------------------------------------------

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
    number = node_sequence_nr(node)
    if number is None:
        return None
    return None if number == _NO_SEQUENCE_NR else (type(node).__name__, number)


def op_tensors(*groups: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among op arguments or results: at the top level or in a list or tuple
    (``Tensor[]``, ``Tensor?[]``, several results), all an aten schema has."""
    for group in groups:
        for value in group:
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (list, tuple)):
                yield from (v for v in value if isinstance(v, torch.Tensor))


class NodeOrigins(Generic[_Where]):
    """Where the forward op call that made each autograd node was made, as a dispatch mode
    sees the forward pass: a backward op of a built-in formula is placed there.

    A node exists only once its forward op has returned through autograd, above the
    dispatch mode: :meth:`made` keeps the outputs of a forward op call that needs
    gradients (weakly) with where it was made, and the next call of :meth:`made` or
    :meth:`of` looks up their nodes, while the outputs are still the arguments of the
    op calls that use them.  That costs a look-up per forward op call that needs
    gradients (autograd's anomaly mode would keep a Python stack per node instead).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[weakref.ref[torch.Tensor], _Where]] = []
        # Autograd node (see _node_key) -> where its forward op was called.
        self._nodes: dict[tuple[str, int], _Where] = {}

    def made(
        self,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        out: Any,
        where: Callable[[], _Where],
    ) -> None:
        """After each forward op call: if its outputs get autograd nodes, they come from
        ``where()``."""
        self._resolve()
        if torch.is_grad_enabled() and any(
            t.requires_grad for t in op_tensors(args, kwargs.values())
        ):
            site = where()
            self._pending = [(weakref.ref(t), site) for t in op_tensors((out,))]

    def of(self, node: Any) -> _Where | None:
        """Where the forward op call that made ``node`` was made, if it was seen."""
        self._resolve()
        key = _node_key(node)
        return None if key is None else self._nodes.get(key)

    def _resolve(self) -> None:
        pending, self._pending = self._pending, []
        for ref, where in pending:
            t = ref()
            key = None if t is None or t.grad_fn is None else _node_key(t.grad_fn)
            if key is not None:
                self._nodes[key] = where


# --- the recorder ---------------------------------------------------------------------------------


#: A default value's stand-in for an argument without one.
_NO_DEFAULT = object()


@functools.lru_cache(maxsize=4096)  # one entry per overload used
def op_schema(func: Any) -> tuple[tuple[tuple[str, bool, Any], ...], dict[str, bool]]:
    """Per argument of op ``func``, in order: its name, whether it is keyword-only, and its
    default (``_NO_DEFAULT`` when it has none); and the arguments it writes to, by name,
    each with whether it is an ``out=`` argument."""
    arguments = func._schema.arguments
    named = tuple(
        (a.name, a.kwarg_only, a.default_value if a.has_default_value() else _NO_DEFAULT)
        for a in arguments
    )
    written = {a.name: a.is_out for a in arguments if a.alias_info and a.alias_info.is_write}
    return named, written


def op_arguments(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a call of op ``func`` by their schema names, in the schema's order,
    defaults filled in."""
    out: dict[str, Any] = {}
    for i, (name, kwarg_only, default) in enumerate(op_schema(func)[0]):
        if i < len(args) and not kwarg_only:
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        elif default is not _NO_DEFAULT:
            out[name] = default
    return out


class _Paused(threading.local):
    """Per thread: how many :meth:`OpRecorder.pause` blocks are open."""

    depth = 0


#: What a :class:`QuietDispatchMode` hands each op call to: ``(func, args, kwargs, caller)``.
_Dispatch = Callable[[Any, tuple[Any, ...], dict[str, Any], FrameType | None], Any]


class QuietDispatchMode(UnwrappedDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that hands every op call to ``dispatch(func, args, kwargs,
    caller)``, ``caller`` being the frame that made the call (the op's own caller, or
    torch's Python code on the way), and never imports ``torch._dynamo`` itself.

    torch would wrap ``__torch_dispatch__`` in a dynamo guard that imports
    ``torch._dynamo`` at its first call (about 2 s in the first recording of a
    process, and a change of process state that traces report); its base,
    :class:`~deterministic_ctx._torch.internals.UnwrappedDispatchMode`, turns that off.
    What the guard protects against is dynamo tracing into this Python code
    while it compiles a function run under the mode; dynamo can do that only
    once it is imported, so ``__torch_dispatch__`` goes through
    ``torch._dynamo.disable`` exactly then, and never imports it itself.

    Example:
        >>> import torch
        >>> seen = []
        >>> def count(func, args, kwargs, caller):
        ...     seen.append((str(func), caller.f_code.co_name))
        ...     return func(*args, **kwargs)
        >>> with QuietDispatchMode(count):
        ...     _ = torch.ones(2)
        >>> seen
        [('aten.ones.default', '<module>')]
    """

    def __init__(self, dispatch: _Dispatch) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dispatch = dispatch

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        dispatch = self.dispatch if DYNAMO not in sys.modules else self._unseen_by_dynamo
        return dispatch(func, args, kwargs or {}, sys._getframe(1))

    @functools.cached_property
    def _unseen_by_dynamo(self) -> _Dispatch:
        """:attr:`dispatch`, which Dynamo never traces (made only once Dynamo is imported)."""
        return dynamo_disable(self.dispatch, recursive=True)


class OpRecorder:
    """A context manager that records every aten op call made inside it.

    ``phase`` chooses which: ``"any"`` (the default), ``"forward"`` (not those
    autograd's engine runs) or ``"backward"`` (only those).  With
    ``inputs=True`` (the default), each tensor input that no earlier recorded
    op made is fingerprinted before every op that reads it.  With
    ``node_locations=True`` the recorder also notes where each forward op
    call that gets autograd nodes was made (:class:`NodeOrigins`), recorded
    or not, and the ops of built-in backward formulas are placed at the
    user's forward line that made their node.

    :meth:`stop` ends the recording early (the rest of the block runs
    unrecorded) and :meth:`pause` leaves out a stretch of one thread's op
    calls (your own bookkeeping, e.g. fingerprints).  After the block,
    :attr:`calls` holds the :class:`OpCall` list, in order.  A recorder
    records once.  Op calls made in other threads are not seen, except those
    autograd's engine makes for a backward pass started inside the block.
    See the module's example.

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> with OpRecorder(phase="backward") as rec:
        ...     (x * 3).sum().backward()
        >>> [(c.op, c.node) for c in rec.calls][:2]
        [('aten.expand.default', 'SumBackward0'), ('aten.mul.Tensor', 'MulBackward0')]
    """

    def __init__(
        self, *, phase: str = "any", inputs: bool = True, node_locations: bool = False
    ) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(map(repr, PHASES))}, got {phase!r}")
        check_bool(inputs, "inputs")
        check_bool(node_locations, "node_locations")
        self.phase = phase
        self.inputs = inputs
        self._origins = NodeOrigins[tuple[str, str] | None]() if node_locations else None
        self._mode = QuietDispatchMode(self._dispatch)
        self._state = "new"  # -> "recording" -> ("stopped" ->) "done"
        self._mode_on = False
        self._owner = 0
        self._paused = _Paused()
        self._lock = threading.Lock()  # backward ops of other devices run on autograd's threads
        self._store = FingerprintStore()
        # Per op call: op, (location, function), node, and per tensor its path, shape, dtype
        # and slot, for outputs and for inputs; made into OpCalls at exit.
        self._records: list[_Record] = []
        # Tensors whose values a recorded op made (its outputs, or arguments it changed in
        # place): id -> the tensor, weakly.  Not their version: inside the dispatch mode a
        # view's version counter is not yet its base's, and a change in place through torch
        # is a recorded op anyway.
        self._known: dict[int, weakref.ref[torch.Tensor]] = {}
        self._calls: list[OpCall] | None = None

    # The context manager.

    def __enter__(self) -> OpRecorder:
        if self._state != "new":
            raise MisuseError("an OpRecorder records once: make a new one")
        self._owner = threading.get_ident()
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        self._mode_on = True
        self._state = "recording"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == "done":
            return
        self._state = "done"
        if self._mode_on:
            self._mode_on = False
            self._mode.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        data = self._store.host()
        self._calls = [
            OpCall(
                index,
                op,
                None if where is None else where[0],
                None if where is None else where[1],
                node,
                tuple(_printed(leaf, data) for leaf in outputs),
                tuple(_printed(leaf, data) for leaf in inputs),
            )
            for index, (op, where, node, outputs, inputs) in enumerate(self._records)
        ]
        self._records.clear()
        self._known.clear()

    @property
    def calls(self) -> list[OpCall]:
        """The op calls recorded, in order; available once the recorder has exited."""
        if self._calls is None:
            raise MisuseError("OpRecorder.calls is available once the recorder has exited")
        return self._calls

    @property
    def count(self) -> int:
        """How many op calls have been recorded so far: a position in the recording, by
        which other records (a run's events, module calls) are placed among its op calls."""
        calls = self._calls
        return len(self._records) if calls is None else len(calls)

    def stop(self) -> None:
        """Record nothing more.  Called in the thread that entered the recorder while its
        mode is the innermost one, outside a backward pass, this also takes the mode off
        at once, so the rest of the block runs at full speed; the recording is finished
        at exit."""
        if self._state != "recording":
            return
        self._state = "stopped"
        # Autograd's engine runs a backward pass with a copy of the caller's thread-local
        # state, the mode stack included, and puts the original back when it is done: a
        # mode taken off in there would be back on afterwards.
        if (
            self._mode_on
            and threading.get_ident() == self._owner
            and current_autograd_node() is None
            and current_dispatch_mode() is self._mode
        ):
            self._mode_on = False
            self._mode.__exit__(None, None, None)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Leave out the op calls that this thread makes inside the ``with`` block.

        Example:
            >>> import torch
            >>> with OpRecorder() as rec:
            ...     x = torch.ones(2)
            ...     with rec.pause():
            ...         _ = x + 1
            >>> [c.op for c in rec.calls]
            ['aten.ones.default']
        """
        local = self._paused
        local.depth += 1
        try:
            yield
        finally:
            local.depth -= 1

    # What the mode calls.

    def _dispatch(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], caller: FrameType | None
    ) -> Any:
        if self._state != "recording" or self._paused.depth:
            return func(*args, **kwargs)
        node = current_autograd_node()
        where = None
        if self.phase == ("backward" if node is None else "forward"):
            out = func(*args, **kwargs)
        else:
            where = self._where(caller, node)
            arguments = op_arguments(func, args, kwargs)
            with self._lock:
                inputs = self._outside_inputs(arguments) if self.inputs else []
            out = func(*args, **kwargs)
            with self._lock:
                outputs = self._outputs(func, arguments, out)
                self._records.append(
                    (str(func), where, None if node is None else node.name(), outputs, inputs)
                )
        if node is None and self._origins is not None:  # forward op calls make nodes
            self._origins.made(args, kwargs, out, lambda: where or self._where(caller, None))
        return out

    def _where(self, caller: FrameType | None, node: Any) -> tuple[str, str] | None:
        """``(file:line, function)`` of the user's code responsible for an op call made
        from ``caller`` (for autograd node ``node``, if any)."""
        frame, engine, _ = user_frame(caller)
        where = None
        if frame is not None:
            where = f"{frame.f_code.co_filename}:{frame.f_lineno}", _qualname(frame.f_code)
        if node is not None and (frame is None or engine) and self._origins is not None:
            # A built-in backward formula: the user's line is where the node was made.
            where = self._origins.of(node) or where
        return where

    def _leaf(self, path: str, t: torch.Tensor) -> _Leaf:
        return path, tuple(t.shape), str(t.dtype).removeprefix("torch."), self._store.add(t)

    def _outside_inputs(self, arguments: dict[str, Any]) -> list[_Leaf]:
        found: list[_Leaf] = []
        for name, value in arguments.items():
            for path, t in tensor_leaves(value, f"input {name!r}"):
                known = self._known.get(id(t))
                if known is not None and known() is t:
                    continue
                found.append(self._leaf(path, t))
        return found

    def _outputs(self, func: Any, arguments: dict[str, Any], out: Any) -> list[_Leaf]:
        leaves: list[_Leaf] = []
        returned: list[torch.Tensor] = []
        if isinstance(out, (bool, int, float, complex)):  # .item(), is_nonzero, equal, ...
            leaves.append(("output", (), type(out).__name__, ("number", repr(out))))
        else:
            for path, t in tensor_leaves(out, "output"):
                leaves.append(self._leaf(path, t))
                returned.append(t)
        for name in op_schema(func)[1]:  # the arguments it writes to, in the schema's order
            for path, t in tensor_leaves(arguments.get(name), name):
                if all(t is not r for r in returned):
                    leaves.append(self._leaf(f"{path} (changed in place)", t))
                    returned.append(t)
        for t in returned:
            self._known[id(t)] = weakref.ref(t)
        return leaves


def _printed(leaf: _Leaf, data: list[bytes]) -> TensorPrint:
    path, shape, dtype, slot = leaf
    if slot is None:
        fingerprint = None
    elif slot[0] == "number":
        fingerprint = slot[1].encode()
    else:
        fingerprint = data[slot[0]][slot[1] : slot[2]]
    return TensorPrint(path, shape, dtype, fingerprint)
