"""Recording one run: global module hooks that fingerprint every call, in call order.

:func:`~deterministic_ctx.locate.locate_divergence` records each run with
:func:`record_run`: a fresh ``deterministic`` block with global forward hooks
that fingerprint, in call order, the outputs of every module call (and, with
``backward=True``, the gradients flowing into each call's inputs and
parameters), then the gradients, parameters and buffers once ``fn`` returned.
A run keeps only 16 bytes per tensor and moves them to the host once, at its
end; a run asked to ``capture`` one event also keeps a copy of its tensors.

Example:
    >>> import torch
    >>> from deterministic_ctx import deterministic
    >>> from deterministic_ctx.record import record_run
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> run = record_run(deterministic(0), model, (torch.ones(1, 2),), {}, [model], backward=False)
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
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

from .compare import tensor_leaves
from .context import deterministic
from .fingerprint import fingerprint
from .rerun import call_and_consume

__all__ = ["Event", "Run", "record_run"]


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of a run's timeline: some tensors at one place, and where their
    fingerprints are.

    ``phase`` is ``"forward"`` (a module's outputs), ``"backward"`` (a gradient),
    ``"final"`` (a gradient, parameter or buffer after ``fn`` returned) or
    ``"result"`` (the return value, compared whole rather than fingerprinted).
    ``key`` identifies the event across runs; ``root``, ``module`` and
    ``module_type`` name the module (``None`` for the return value) and
    ``call_index`` its call.  ``slots`` holds each tensor's first sum in the
    run's list, or ``None`` when it has no fingerprint.

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
    slots: tuple[int | None, ...] = ()


class _Names:
    """Qualified module names, relative to the root module they were found in.

    Roots are the modules given up front, then any module whose name is not
    known when it is first called (a model built inside ``fn``): its pre-hook
    runs before its children's, so they are named relative to it.
    """

    def __init__(self, roots: Iterable[torch.nn.Module]) -> None:
        self._names: dict[int, tuple[str, str]] = {}
        self.roots: list[torch.nn.Module] = []  # also keeps ids valid for the run
        for root in roots:
            self.of(root)

    def of(self, module: torch.nn.Module) -> tuple[str, str]:
        found = self._names.get(id(module))
        if found is None:
            self.roots.append(module)
            label = type(module).__qualname__
            for name, sub in module.named_modules():
                self._names.setdefault(id(sub), (label, name))
            found = self._names[id(module)]
        return found


class _Recorder:
    """The hooks of one run and what they recorded."""

    def __init__(self, names: _Names, *, backward: bool, capture: tuple[Any, ...] | None) -> None:
        self.names = names
        self.backward = backward
        self.capture = capture
        self.captured: list[tuple[str, torch.Tensor]] | None = None
        self.events: list[Event] = []
        self.sums: list[torch.Tensor] = []
        # Per module call, in the order calls start: who was called, and how many
        # events had been recorded by then (where the call sits in the timeline).
        self.structure: list[tuple[str, str, str]] = []
        self.starts: list[int] = []
        self._thread = threading.get_ident()
        self._stack: list[tuple[torch.nn.Module, int]] = []
        self._last_call: dict[int, int] = {}
        self._occurrences: dict[tuple[Any, ...], int] = {}
        self._param_hooked: set[int] = set()
        self._handles: list[Any] = []
        # A container's output is usually its last child's output tensor: reuse its sums.
        self._last: tuple[Any, int, int] | None = None
        # Backward hooks of CUDA tensors run on autograd's device threads.
        self._lock = threading.Lock()

    def record(
        self,
        base: tuple[Any, ...],
        phase: str,
        module: torch.nn.Module,
        call_index: int | None,
        what: str,
        leaves: list[tuple[str, torch.Tensor]],
    ) -> None:
        root, name = self.names.of(module)
        with self._lock:
            occurrence = self._occurrences.get(base, 0)
            self._occurrences[base] = occurrence + 1
            key = (*base, occurrence)
            slots: list[int | None] = []
            for _, t in leaves:
                last = self._last
                if last is not None and last[0]() is t and last[1] == t._version:
                    slots.append(last[2])
                    continue
                pair = fingerprint(t)
                if pair is None:
                    slots.append(None)
                    continue
                slots.append(len(self.sums))
                self._last = (weakref.ref(t), t._version, len(self.sums))
                self.sums.extend(pair)
            self.events.append(
                Event(
                    key=key,
                    phase=phase,
                    what=what,
                    root=root,
                    module=name,
                    module_type=type(module).__qualname__,
                    call_index=call_index,
                    paths=tuple(p for p, _ in leaves),
                    shapes=tuple(tuple(t.shape) for _, t in leaves),
                    dtypes=tuple(str(t.dtype).removeprefix("torch.") for _, t in leaves),
                    slots=tuple(slots),
                )
            )
            if key == self.capture:
                self.captured = [(p, t.detach().clone()) for p, t in leaves]

    # Global module hooks: every module call in this thread while the run lasts.

    def pre_hook(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() != self._thread:
            return
        index = len(self.structure)
        self._stack.append((module, index))
        self._last_call[id(module)] = index
        root, name = self.names.of(module)
        with self._lock:
            self.structure.append((root, name, type(module).__qualname__))
            self.starts.append(len(self.events))
        if not self.backward:
            return
        # Registered before the body runs, so a later in-place change of the
        # input does not redirect the hook.
        hooks = [
            (t, functools.partial(self._input_grad, module, index, path))
            for path, t in tensor_leaves(args, "input")
        ]
        if id(module) not in self._param_hooked:
            self._param_hooked.add(id(module))
            hooks += [
                (p, functools.partial(self._param_grad, module, pname))
                for pname, p in module.named_parameters(recurse=False)
            ]
        for t, hook in hooks:
            # A tensor that takes no hooks is skipped: never break the model being observed.
            if t.requires_grad:
                with contextlib.suppress(RuntimeError):
                    self._handles.append(t.register_hook(hook))  # type: ignore[no-untyped-call]

    def post_hook(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        for depth in range(len(self._stack) - 1, -1, -1):
            if self._stack[depth][0] is module:
                index = self._stack[depth][1]
                del self._stack[depth:]
                break
        else:
            return  # entered before the hooks were installed
        self.record(
            ("forward", index),
            "forward",
            module,
            index,
            "output",
            list(tensor_leaves(output, "output")),
        )

    def _input_grad(
        self, module: torch.nn.Module, index: int, path: str, grad: torch.Tensor
    ) -> None:
        self.record(
            ("grad", index, path),
            "backward",
            module,
            index,
            f"gradient w.r.t. {path}",
            [(f"grad of {path}", grad)],
        )

    def _param_grad(self, module: torch.nn.Module, pname: str, grad: torch.Tensor) -> None:
        root, name = self.names.of(module)
        self.record(
            ("param grad", root, name, pname),
            "backward",
            module,
            self._last_call.get(id(module)),
            f"gradient of parameter {pname!r}",
            [(f"grad of {pname}", grad)],
        )

    def final_state(self) -> None:
        """Fingerprint the gradients, then the parameters and buffers, of every known root
        after ``fn`` returned.

        Gradients come first because they cause an update's changes, and in reverse
        parameter order, roughly the order backward computes them: the first that
        differs is then the one nearest the cause.
        """
        tensors: list[tuple[torch.nn.Module, str, str, torch.Tensor]] = []
        seen: set[int] = set()
        for root in list(self.names.roots):
            label = type(root).__qualname__
            for qualname, t in itertools.chain(root.named_parameters(), root.named_buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors.append((root, label, qualname, t))
        for root, label, qualname, t in reversed(tensors):
            if isinstance(t, torch.nn.Parameter) and t.grad is not None:
                self._final(root, label, qualname, "gradient of parameter", t.grad)
        for root, label, qualname, t in tensors:
            kind = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
            self._final(root, label, qualname, kind, t)

    def _final(
        self, root: torch.nn.Module, label: str, qualname: str, kind: str, t: torch.Tensor
    ) -> None:
        owner_name, _, leaf = qualname.rpartition(".")
        self.record(
            ("final", kind, label, qualname),
            "final",
            root.get_submodule(owner_name),
            None,
            f"{kind} {leaf!r} after fn returned",
            [(leaf, t)],
        )

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def host_sums(self) -> list[int]:
        """All sums as Python ints: one stack and one copy per device."""
        out = [0] * len(self.sums)
        by_device: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self.sums):
            by_device.setdefault(s.device, []).append(i)
        for positions in by_device.values():
            values = torch.stack([self.sums[i] for i in positions]).cpu().tolist()
            for i, v in zip(positions, values, strict=True):
                out[i] = v
        return out


@dataclasses.dataclass(frozen=True)
class Run:
    """What one run recorded.

    ``events`` in the order they happened (the ``"final"`` ones last), their
    fingerprints' sums in ``sums``, the return value, ``structure`` (who was
    called, per module call, in the order calls start: ``(root, name, class
    name)``), ``starts`` (how many events had been recorded when each call
    started) and ``captured`` (the tensors of the event asked for, if it
    happened).  See the module's example.
    """

    events: list[Event]
    sums: list[int]
    result: Any
    structure: list[tuple[str, str, str]]
    starts: list[int]
    captured: list[tuple[str, torch.Tensor]] | None

    def fingerprints(self, event: Event) -> tuple[tuple[int, int] | None, ...]:
        """The fingerprints of ``event``'s tensors, as pairs of ints (``None``: none)."""
        return tuple(None if s is None else (self.sums[s], self.sums[s + 1]) for s in event.slots)


def record_run(
    block: deterministic,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    roots: list[torch.nn.Module],
    *,
    backward: bool,
    capture: tuple[Any, ...] | None = None,
) -> Run:
    """Run ``fn(*args, **kwargs)`` once in ``block`` and record it.

    ``roots`` are the models whose modules are named relative to them (others
    are found as they are called); ``backward`` adds gradient fingerprints;
    ``capture`` is the key of an event whose tensors are kept.  See the
    module's example.
    """
    rec = _Recorder(_Names(roots), backward=backward, capture=capture)
    with block:
        handles = [
            _nn_module.register_module_forward_pre_hook(rec.pre_hook),
            _nn_module.register_module_forward_hook(rec.post_hook),
        ]
        try:
            result = call_and_consume(fn, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()
            rec.remove_hooks()
        rec.final_state()
    return Run(rec.events, rec.host_sums(), result, rec.structure, rec.starts, rec.captured)
