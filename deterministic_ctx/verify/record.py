"""Recording one run: global module hooks that fingerprint every call, in call order.

:func:`~deterministic_ctx.verify.locate.locate_divergence` records each run in
a fresh ``deterministic`` block with global forward hooks
that fingerprint, in call order, the outputs of every module call (and, with
``backward=True``, the gradients flowing into each call's inputs and
parameters), then the gradients, parameters and buffers once ``fn`` returned.
A run keeps only the fingerprints (a few integer sums per tensor, on the
tensor's device: no host sync per call) and moves them to the host once, at
its end; a run asked to ``capture`` one event also keeps a copy of its tensors,
and a run given an :class:`OpWindow` records the aten op calls in that window
(an :class:`~deterministic_ctx.verify.ops.OpRecorder` entered and left by the hooks).
:func:`record` returns the run as the hooks left it (a :class:`Run`): two
runs that recorded exactly the same are found equal in one comparison, and its
:class:`Event` objects are only made when a run is looked at event by event
(:attr:`Run.events`).

Example:
    >>> import torch
    >>> from deterministic_ctx import deterministic
    >>> from deterministic_ctx.verify.record import record
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> run = record(deterministic(0), model, (torch.ones(1, 2),), {}, [model], backward=False)
    >>> [(e.phase, e.module, e.what) for e in run.events][:3]
    [('forward', '0', 'output'), ('forward', '1', 'output'), ('forward', '', 'output')]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

from ..core.context import deterministic
from .compare import tensor_leaves
from .fingerprint import FingerprintStore
from .fingerprint import Slot as _Slot
from .ops import OpCall, OpRecorder
from .rerun import call_and_consume

__all__ = ["Event", "ModuleNames", "OpWindow", "Run", "record"]

#: Looked up once: the hooks call it twice per module call.
_get_ident = threading.get_ident
#: An event as the hooks record it (or as a trace holds it): key, phase, what, ``(root,
#: module, class name)``, call index, and per tensor its path, shape, dtype and slot.
_Record = tuple[
    tuple[Any, ...],
    str,
    str,
    tuple[str | None, str | None, str | None],
    int | None,
    Sequence[tuple[str, tuple[int, ...], torch.dtype | str, _Slot | None]],
]


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of a run's timeline: some tensors at one place, and where their
    fingerprints are.

    ``phase`` is ``"forward"`` (a module's outputs), ``"backward"`` (a gradient),
    ``"final"`` (a gradient, parameter or buffer after ``fn`` returned) or
    ``"result"`` (the return value, compared whole rather than fingerprinted).
    ``key`` identifies the event across runs; ``root``, ``module`` and
    ``module_type`` name the module (``None`` for the return value) and
    ``call_index`` its call.  ``slots`` says where each tensor's fingerprint is
    in the run's data, ``(buffer, start, stop)`` in bytes, or ``None`` when it
    has none.

    Example:
        >>> Event(("result",), "result", 'result["loss"]').module is None
        True
    """

    key: tuple[Any, ...]
    phase: str
    what: str
    root: str | None = None
    module: str | None = None
    module_type: str | None = None
    call_index: int | None = None
    paths: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    slots: tuple[_Slot | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class OpWindow:
    """Which aten op calls of a run to record.

    At most one of: ``call`` (only while module call #``call`` runs, its
    children's op calls included), ``before_call`` (from the start of ``fn``
    until module call #``before_call`` starts, or ``fn`` returns) and ``until``
    (from the start until the event with this key has been recorded); none of
    them: the whole call of ``fn``.  ``backward=True`` keeps only the op calls
    that autograd's engine runs, and places those of built-in backward
    formulas at the forward line that made their node (see
    :class:`~deterministic_ctx.verify.ops.OpRecorder`'s ``node_locations``).

    Example:
        >>> OpWindow(call=3).describe()
        'during module call #3'
    """

    call: int | None = None
    before_call: int | None = None
    until: tuple[Any, ...] | None = None
    backward: bool = False

    def describe(self) -> str:
        """Where the window is, for messages."""
        if self.call is not None:
            return f"during module call #{self.call}"
        if self.before_call is not None:
            return f"before module call #{self.before_call}"
        if self.until is not None:
            return "in the backward pass up to that gradient"
        return "in the backward pass" if self.backward else "in the whole run"


class ModuleNames:
    """Labels of modules, ``(root, qualified name, class name)``, the name relative to the
    root module it was found in.

    Roots are the modules given up front, then any module whose name is not
    known when it is first called (a model built inside ``fn``): its pre-hook
    runs before its children's, so they are named relative to it.  The labels
    of a root's modules are all made when it is walked, so that the hooks find
    a module's in one lookup.
    """

    def __init__(self, roots: Iterable[torch.nn.Module]) -> None:
        self.labels: dict[int, tuple[str, str, str]] = {}
        self.roots: list[torch.nn.Module] = []  # also keeps ids valid for the run
        for root in roots:
            self.of(root)

    def of(self, module: torch.nn.Module) -> tuple[str, str, str]:
        found = self.labels.get(id(module))
        if found is None:
            self.roots.append(module)
            root = type(module).__qualname__
            for name, sub in module.named_modules():
                self.labels.setdefault(id(sub), (root, name, type(sub).__qualname__))
            found = self.labels[id(module)]
        return found


class _Recorder:
    """The hooks of one run and what they recorded."""

    def __init__(
        self,
        names: ModuleNames,
        *,
        backward: bool,
        capture: tuple[Any, ...] | None,
        window: OpWindow | None = None,
    ) -> None:
        self.names = names
        self.backward = backward
        self.capture = capture
        self.captured: list[tuple[str, torch.Tensor]] | None = None
        # What each event needs, in the order events happen; the Event objects are made
        # after the run, and only if it is looked at event by event (see Run.events).
        self.records: list[_Record] = []
        # Fingerprints stay on their devices until the run ends.
        self._store = FingerprintStore()
        # The op recorder of the window, if any: entered and left by the hooks (or around
        # the whole call of fn), and paused while the hooks fingerprint.
        self.window = OpWindow() if window is None else window
        self.ops: OpRecorder | None = None
        if window is not None:
            self.ops = OpRecorder(
                phase="backward" if window.backward else "any", node_locations=window.backward
            )
        # Per module call, in the order calls start: who was called, and how many
        # events had been recorded by then (where the call sits in the timeline).
        self.structure: list[tuple[str, str, str]] = []
        self.starts: list[int] = []
        # With a window, how many op calls had been recorded when each event was recorded
        # and when each module call started: where the op calls sit in the timeline.
        self.ops_at_events: list[int] = []
        self.ops_at_calls: list[int] = []
        self._thread = threading.get_ident()
        self._stack: list[tuple[torch.nn.Module, int, tuple[str, str, str]]] = []
        self._last_call: dict[int, int] = {}
        self._occurrences: dict[tuple[Any, ...], int] = {}
        self._labels = names.labels
        self.handles: list[Any] = []  # of the gradient hooks
        # A container's output is usually its last child's output tensor: reuse its
        # fingerprint while the tensor is unchanged (same version).
        self._last: tuple[Any, int | None, _Slot] | None = None
        # Backward hooks of CUDA tensors run on autograd's device threads.
        self._lock = threading.Lock()

    def record(
        self,
        base: tuple[Any, ...],
        phase: str,
        label: tuple[str, str, str],
        call_index: int | None,
        what: str,
        leaves: list[tuple[str, torch.Tensor]],
        slots: list[_Slot | None] | None = None,
        *,
        once: bool = False,
    ) -> None:
        """Record an event of the module labelled ``label``: ``leaves`` fingerprinted now,
        or where ``slots`` says their fingerprints are.  ``once``: the caller records
        ``base`` at most once per run (a module call's outputs), so its key needs no
        count of occurrences."""
        ops = self.ops
        # The fingerprints are not the model's op calls.
        with contextlib.nullcontext() if ops is None else ops.pause(), self._lock:
            if once:
                key = (*base, 0)
            else:
                occurrence = self._occurrences.get(base, 0)
                self._occurrences[base] = occurrence + 1
                key = (*base, occurrence)
            if slots is None:
                fingerprint = self._fingerprint
                tensors = [(p, t.shape, t.dtype, fingerprint(t)) for p, t in leaves]
            else:
                tensors = [
                    (p, t.shape, t.dtype, slot) for (p, t), slot in zip(leaves, slots, strict=True)
                ]
            self.records.append((key, phase, what, label, call_index, tensors))
            if ops is not None:
                self.ops_at_events.append(ops.count)
            if key == self.capture:
                self.captured = [(p, t.detach().clone()) for p, t in leaves]
        if ops is not None and key == self.window.until:
            ops.stop()

    def _fingerprint(self, t: torch.Tensor) -> _Slot | None:
        """Fingerprint ``t`` (or reuse the last one, for the same unchanged tensor); where
        it will be in the run's data."""
        # Inference tensors have no version counter: a change in place would go unseen.
        version = None if t.is_inference() else t._version
        last = self._last
        if last is not None and version is not None and last[0]() is t and last[1] == version:
            return last[2]
        slot = self._store.add(t)
        if slot is not None:
            self._last = (weakref.ref(t), version, slot)
        return slot

    # Global module hooks: every module call in this thread while the run lasts.  They
    # run twice per module call, so they do little: the label found once per module, and
    # carried from the pre-hook to the post-hook on the stack of calls.

    def pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if _get_ident() != self._thread:
            return
        structure = self.structure
        index = len(structure)
        label = self._labels.get(id(module)) or self.names.of(module)
        self._stack.append((module, index, label))
        ops = self.ops
        with self._lock:
            structure.append(label)
            self.starts.append(len(self.records))
            if ops is not None:
                self.ops_at_calls.append(ops.count)
        if ops is not None:  # the op window may open or close here
            if self.window.call == index:
                ops.__enter__()
            elif self.window.before_call == index:
                ops.stop()
        if self.backward:
            self._hook_gradients(module, index, label, args)

    def _hook_gradients(
        self, module: torch.nn.Module, index: int, label: tuple[str, str, str], args: Any
    ) -> None:
        """Gradient hooks on the inputs of call #``index`` of ``module`` and, on its first
        call, on its parameters."""
        first_call = id(module) not in self._last_call
        self._last_call[id(module)] = index
        # Registered before the body runs, so a later in-place change of the
        # input does not redirect the hook.
        hooks = [
            (t, functools.partial(self._gradient, label, index, path))
            for path, t in tensor_leaves(args, "input")
        ]
        if first_call:
            hooks += [
                (p, functools.partial(self._gradient, label, module, pname))
                for pname, p in module.named_parameters(recurse=False)
            ]
        for t, hook in hooks:
            # A tensor that takes no hooks is skipped: never break the model being observed.
            if t.requires_grad:
                with contextlib.suppress(RuntimeError):
                    self.handles.append(t.register_hook(hook))  # type: ignore[no-untyped-call]

    def post_hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _get_ident() != self._thread:
            return
        stack = self._stack
        if stack and stack[-1][0] is module:  # calls nest: the last one started ends first
            _, index, label = stack.pop()
        else:
            for depth in range(len(stack) - 1, -1, -1):
                if stack[depth][0] is module:
                    _, index, label = stack[depth]
                    del stack[depth:]
                    break
            else:
                return  # entered before the hooks were installed
        leaves = list(tensor_leaves(output, "output"))
        # Each call index leaves the stack once: its outputs are recorded once.
        self.record(("forward", index), "forward", label, index, "output", leaves, once=True)
        if self.ops is not None and self.window.call == index:
            self.ops.__exit__(None, None, None)

    def _gradient(
        self,
        label: tuple[str, str, str],
        call: int | torch.nn.Module,
        name: str,
        grad: torch.Tensor,
    ) -> None:
        """A gradient hook: record ``grad``, of the input ``name`` of call #``call``, or of
        the parameter ``name`` of the module ``call`` (in its last call)."""
        base: tuple[Any, ...]
        index: int | None
        if isinstance(call, int):
            base = ("grad", call, name)
            index = call
            what = f"gradient w.r.t. {name}"
        else:
            base = ("param grad", label[0], label[1], name)
            index = self._last_call.get(id(call))
            what = f"gradient of parameter {name!r}"
        self.record(base, "backward", label, index, what, [(f"grad of {name}", grad)])

    def final_state(self) -> None:
        """Fingerprint the gradients, then the parameters and buffers, of every known root
        after ``fn`` returned.

        Gradients come first because they cause an update's changes, and in reverse
        parameter order, roughly the order backward computes them: the first that
        differs is then the one nearest the cause.
        """
        # Found through each module's own tables rather than named_parameters() and
        # get_submodule(): one walk per root, in the same order, with the owner at hand.
        tensors: list[tuple[torch.nn.Module, str, str, str, torch.Tensor]] = []
        seen: set[int] = set()
        for root in list(self.names.roots):
            label = type(root).__qualname__
            params: list[tuple[torch.nn.Module, str, str, str, torch.Tensor]] = []
            buffers: list[tuple[torch.nn.Module, str, str, str, torch.Tensor]] = []
            for prefix, module in root.named_modules():
                for table, found in ((module._parameters, params), (module._buffers, buffers)):
                    for leaf, t in table.items():
                        if t is not None:
                            qualname = f"{prefix}.{leaf}" if prefix else leaf
                            found.append((module, label, qualname, leaf, t))
            for entry in itertools.chain(params, buffers):
                if id(entry[4]) not in seen:
                    seen.add(id(entry[4]))
                    tensors.append(entry)
        # isinstance(t, Parameter) runs Python code (Parameter's metaclass): once per tensor.
        kinds = [
            "parameter" if isinstance(t, torch.nn.Parameter) else "buffer" for *_, t in tensors
        ]
        finals = [
            (module, label, qualname, leaf, "gradient of parameter", t.grad)
            for (module, label, qualname, leaf, t), kind in zip(
                reversed(tensors), reversed(kinds), strict=True
            )
            if kind == "parameter" and t.grad is not None
        ]
        finals += [
            (module, label, qualname, leaf, kind, t)
            for (module, label, qualname, leaf, t), kind in zip(tensors, kinds, strict=True)
        ]
        # All at once: nothing changes them any more, so their small fingerprints (and
        # the words past each table's last row) are copied in one operation, not one each.
        with contextlib.nullcontext() if self.ops is None else self.ops.pause():
            slots = self._store.add_all([entry[5] for entry in finals])
        for (module, label, qualname, leaf, kind, t), slot in zip(finals, slots, strict=True):
            base = ("final", kind, label, qualname)
            what = f"{kind} {leaf!r} after fn returned"
            label_of = self._labels.get(id(module)) or self.names.of(module)
            self.record(base, "final", label_of, None, what, [(leaf, t)], [slot])


@dataclasses.dataclass(eq=False)
class Run:
    """What one run recorded.

    ``records`` are the events as the hooks left them, in the order they
    happened (the ``"final"`` ones last): :attr:`events` makes the
    :class:`Event` objects from them on first use, when a run is looked at
    event by event, and :meth:`agreement` compares two runs whole without
    them.  Then the bytes of their fingerprints in ``data`` (one buffer per
    device), the return value, ``structure`` (who was called, per module call,
    in the order calls start: ``(root, name, class name)``), ``starts`` (how
    many events had been recorded when each call started), ``captured`` (the
    tensors of the event asked for, if it happened) and ``ops`` (the op calls
    of the window asked for; ``None`` without one).  With a window,
    ``ops_at_events`` and ``ops_at_calls`` say how many op calls had been
    recorded when each event was recorded and when each module call started
    (where the op calls sit in the timeline).  Made by :func:`record`; see the
    module's example.
    """

    records: Sequence[_Record]
    data: list[bytes]
    result: Any
    structure: list[tuple[str, str, str]]
    starts: list[int]
    captured: list[tuple[str, torch.Tensor]] | None
    ops: list[OpCall] | None = None
    ops_at_events: list[int] | None = None
    ops_at_calls: list[int] | None = None

    @functools.cached_property
    def events(self) -> list[Event]:
        """The events of :attr:`records`, in order: made in one go on first use, once a run
        is looked at event by event, never in the hooks while the model runs."""
        return [
            Event(
                key,
                phase,
                what,
                root,
                module,
                module_type,
                call_index,
                tuple([p for p, _, _, _ in tensors]),
                tuple([tuple(shape) for _, shape, _, _ in tensors]),
                tuple([str(dtype).removeprefix("torch.") for _, _, dtype, _ in tensors]),
                tuple([slot for _, _, _, slot in tensors]),
            )
            for key, phase, what, (root, module, module_type), call_index, tensors in self.records
        ]

    def fingerprints(self, event: Event) -> tuple[bytes | None, ...]:
        """The fingerprints of ``event``'s tensors, as bytes (``None``: none).

        Tensors of one shape and dtype with equal bits have equal fingerprints;
        one changed element, or two different elements that trade places, give
        another (see :func:`~deterministic_ctx.verify.fingerprint.fingerprint_parts`).
        """
        data = self.data
        return tuple([None if s is None else data[s[0]][s[1] : s[2]] for s in event.slots])

    def agreement(self, other: Run) -> int | None:
        """How many events agree, if ``other`` recorded exactly what this run did; else
        ``None``.

        Exactly: the same module calls in the same order, each started after the same
        number of events; the same events (keys, names, tensor paths, shapes and dtypes)
        in the same order; the same fingerprint bytes in the same places.  Then
        :func:`~deterministic_ctx.verify.timeline.compare_runs` finds no difference (but perhaps
        in the return values, which this does not compare) and counts as agreeing the
        events before the first ``"final"`` one, then the ``"final"`` ones, which are the
        last: every event.  That count is returned, found in one comparison of the records
        and without making an :class:`Event`.  For anything else, walk the runs with
        ``compare_runs``.

        Example:
            >>> import torch
            >>> from deterministic_ctx import deterministic
            >>> model = torch.nn.Linear(2, 2)
            >>> a, b = (record(deterministic(0), model, (torch.ones(1, 2),), {}, [model],
            ...                backward=False) for _ in "ab")
            >>> a.agreement(b), len(a.events)
            (3, 3)
        """
        if (
            self.structure != other.structure
            or self.starts != other.starts
            or self.data != other.data
            or self.records != other.records
        ):
            return None
        return len(self.records)


def record(
    block: deterministic,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    roots: list[torch.nn.Module],
    *,
    backward: bool,
    capture: tuple[Any, ...] | None = None,
    ops: OpWindow | None = None,
) -> Run:
    """Run ``fn(*args, **kwargs)`` once in ``block`` and record it.

    ``roots`` are the models whose modules are named relative to them (others
    are found as they are called); ``backward`` adds gradient fingerprints;
    ``capture`` is the key of an event whose tensors are kept; ``ops`` a
    window whose aten op calls are recorded.  See the module's example and
    :meth:`Run.agreement`.
    """
    rec = _Recorder(ModuleNames(roots), backward=backward, capture=capture, window=ops)
    with block:
        module_hooks = [
            _nn_module.register_module_forward_pre_hook(rec.pre_hook),
            _nn_module.register_module_forward_hook(rec.post_hook),
        ]
        try:
            if rec.ops is not None and rec.window.call is None:
                rec.ops.__enter__()  # at the start of fn, unless the window is one call
            try:
                result = call_and_consume(fn, args, kwargs)
            finally:
                if rec.ops is not None:  # a no-op if left already; never entered: no calls
                    rec.ops.__exit__(None, None, None)
        finally:
            for handle in module_hooks + rec.handles:
                handle.remove()
        rec.final_state()
    # Every fingerprint's bytes, per device: one concatenation and one copy each (the
    # only host sync of the run, besides an op window's).
    data = rec._store.host()
    op_calls = None if rec.ops is None else rec.ops.calls
    marks = (None, None) if op_calls is None else (rec.ops_at_events, rec.ops_at_calls)
    return Run(rec.records, data, result, rec.structure, rec.starts, rec.captured, op_calls, *marks)
