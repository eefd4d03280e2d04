"""``locate_divergence``: the first module call where two runs of PyTorch code differ.

When :func:`~deterministic_ctx.verify.assert_reproducible` says a model is not
reproducible, the next question is *where*.  ``locate_divergence`` runs the
code twice in fresh ``deterministic(seed)`` blocks with global module hooks
that fingerprint, in call order, the outputs of every module call (and, with
``backward=True``, the gradients flowing into each call's inputs and
parameters), then the return value and the final parameters and buffers.
The first fingerprint that differs names the module.

Fingerprints are computed where the tensor lives, without copying it to the
host: two wrapping int64 sums of its bit pattern, one plain and one weighted
by position (so values that trade places are caught too).  A run keeps
only these 16 bytes per tensor and moves them to the host once, at its end.
Only when the runs diverge are two more runs made, which keep the one
differing tensor, to report the first differing index and the max difference.
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

from .context import deterministic
from .verify import (
    _bits,
    _call,
    _check_fn,
    _check_runs,
    _first_difference,
    _resettable,
    _SavedState,
    _tensor_difference,
    _tensor_leaves,
)

__all__ = ["Divergence", "DivergenceReport", "locate_divergence"]

# --- fingerprints ---------------------------------------------------------------------------

_COLUMNS = 1024  # a tensor's bits are read as rows of this many elements
_COLUMN_MIX, _ROW_MIX, _ADD = 0x9E3779B1, 0x85EBCA6B, 0x165667B1
_weights: dict[tuple[torch.device, int], torch.Tensor] = {}


def _mixed(n: int, mix: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * mix + _ADD) & 0x7FFFFFFF) | 1  # odd, below 2**31


def _cached_weights(kind: int, n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` column (``kind`` 0) or row (1) weights on ``device``, cached."""
    w = _weights.get((device, kind))
    if w is None or w.numel() < n:
        size = max(n, _COLUMNS)
        size = 1 << (size - 1).bit_length()  # grow by powers of two
        w = _weights[device, kind] = _mixed(size, (_COLUMN_MIX, _ROW_MIX)[kind], device)
    return w[:n]


def _fingerprint(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Plain and position-weighted int64 sums of ``t``'s bits, as 0-d tensors on its device.

    Element ``i`` of the flattened bits counts once in the plain sum and
    ``row[i // 1024] + column[i % 1024]`` times in the weighted one, so that
    moving values around changes it too.  Computed from the row sums and column
    sums of the bits viewed as a ``(n // 1024, 1024)`` table: two passes of
    native integer reductions, no temporary as large as the tensor.  Integer
    sums wrap modulo 2**64 and are exact, so the result does not depend on the
    reduction order: fingerprints are deterministic on every device, and a
    change of any single element always changes the plain sum.  ``None`` for
    tensors without readable data (meta, or exotic subclasses).
    """
    try:
        if t.is_meta:
            return None
        if t.is_quantized:
            t = t.int_repr()
        elif t.layout != torch.strided:
            t = t.to_dense()
        with torch.no_grad():
            x = _bits(t).reshape(-1)
            rows, tail = divmod(x.numel(), _COLUMNS)
            device = x.device
            # Integer sums are int64 by default; an explicit dtype= is a slower path.
            if rows == 0:
                return x.sum(), (x * _cached_weights(0, tail, device)).sum()
            table = x[: rows * _COLUMNS].view(rows, _COLUMNS)
            row_sums = table.sum(dim=1)
            column_sums = table.sum(dim=0)
            plain = row_sums.sum()
            weighted = (row_sums * _cached_weights(1, rows, device)).sum() + (
                column_sums * _cached_weights(0, _COLUMNS, device)
            ).sum()
            if tail:
                rest = x[rows * _COLUMNS :]
                rest_sum = rest.sum()
                plain = plain + rest_sum
                row_weight = _cached_weights(1, rows + 1, device)[rows]
                weighted = weighted + rest_sum * row_weight
                weighted = weighted + (rest * _cached_weights(0, tail, device)).sum()
            return plain, weighted
    except (RuntimeError, TypeError, ValueError, NotImplementedError, KeyError):
        return None


# --- one run ---------------------------------------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class _Event:
    key: tuple[Any, ...]
    phase: str  # "forward", "backward" or "final"
    root: str
    module: str
    module_type: str
    call_index: int | None
    what: str
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    slots: tuple[int | None, ...]  # each tensor's first sum in the run's list, or None


class _Recorder:
    """The hooks of one run and what they recorded."""

    def __init__(self, names: _Names, *, backward: bool, capture: tuple[Any, ...] | None) -> None:
        self.names = names
        self.backward = backward
        self.capture = capture
        self.captured: list[tuple[str, torch.Tensor]] | None = None
        self.events: list[_Event] = []
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
                pair = _fingerprint(t)
                if pair is None:
                    slots.append(None)
                    continue
                slots.append(len(self.sums))
                self._last = (weakref.ref(t), t._version, len(self.sums))
                self.sums.extend(pair)
            self.events.append(
                _Event(
                    key,
                    phase,
                    root,
                    name,
                    type(module).__qualname__,
                    call_index,
                    what,
                    tuple(p for p, _ in leaves),
                    tuple(tuple(t.shape) for _, t in leaves),
                    tuple(str(t.dtype).removeprefix("torch.") for _, t in leaves),
                    tuple(slots),
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
            for path, t in _tensor_leaves(args, "input")
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
            list(_tensor_leaves(output, "output")),
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
class _Run:
    events: list[_Event]
    sums: list[int]
    result: Any
    structure: list[tuple[str, str, str]]
    starts: list[int]
    captured: list[tuple[str, torch.Tensor]] | None

    def fingerprints(self, event: _Event) -> tuple[tuple[int, int] | None, ...]:
        return tuple(None if s is None else (self.sums[s], self.sums[s + 1]) for s in event.slots)


def _run(
    block: deterministic,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    roots: list[torch.nn.Module],
    *,
    backward: bool,
    capture: tuple[Any, ...] | None = None,
) -> _Run:
    rec = _Recorder(_Names(roots), backward=backward, capture=capture)
    with block:
        handles = [
            _nn_module.register_module_forward_pre_hook(rec.pre_hook),
            _nn_module.register_module_forward_hook(rec.post_hook),
        ]
        try:
            result = _call(fn, args, kwargs)
        finally:
            for handle in handles:
                handle.remove()
            rec.remove_hooks()
        rec.final_state()
    return _Run(rec.events, rec.host_sums(), result, rec.structure, rec.starts, rec.captured)


# --- comparing runs ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where two runs first differ.

    Attributes:
        phase: ``"forward"`` (a module's output), ``"backward"`` (a gradient),
            ``"result"`` (the return value, when every module call agreed) or
            ``"final"`` (a parameter or buffer after ``fn`` returned).
        kind: ``"values"``, ``"shape"`` (shapes or dtypes), ``"call"`` (another
            module was called at that point), ``"missing"`` or ``"extra"`` (a
            call or gradient present in only one run).
        module: qualified name of the module within its root model (``""`` is
            the root itself); ``None`` for the return value.
        module_type: the module's class name.
        root: the class name of the root model.
        call_index: 0-based index of the module call, in the order calls start.
        what: which tensor, e.g. ``"output"``, ``"output[1]"``,
            ``"gradient w.r.t. input[0]"`` or ``'result["loss"]'``.
        shapes / other_shapes: shapes of the tensors in run 1 / the other run.
        index: first differing element, when known.
        max_abs_diff: largest absolute difference, when known.
        run: the run that differed from run 1.
        detail: one readable sentence.
    """

    phase: str
    kind: str
    module: str | None
    module_type: str | None
    root: str | None
    call_index: int | None
    what: str
    shapes: tuple[tuple[int, ...], ...]
    other_shapes: tuple[tuple[int, ...], ...]
    index: tuple[int, ...] | None
    max_abs_diff: float | None
    run: int
    detail: str

    @property
    def location(self) -> str:
        """``blocks.3.noise (Jitter)``-style name of the place, for messages."""
        if self.module is None:
            return self.what
        name = self.module or "(root)"
        return f"{name} ({self.module_type})"


@dataclasses.dataclass(frozen=True)
class DivergenceReport:
    """What :func:`locate_divergence` found.

    ``agree`` is true when every recorded fingerprint, the return value and
    the final parameters matched in all runs; otherwise ``divergence`` says
    where the runs first differ.  ``calls`` is the number of module calls in
    run 1, ``compared`` the number of fingerprinted events (outputs, gradients,
    final tensors) that agreed before the divergence, or in all.
    ``str(report)`` is a readable summary and ``to_dict()`` a JSON-serializable one.
    """

    seed: int
    runs: int
    backward: bool
    calls: int
    compared: int
    divergence: Divergence | None

    @property
    def agree(self) -> bool:
        return self.divergence is None

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ints, strings, lists, dicts and ``None`` only.

        Example:
            >>> import json, torch
            >>> report = locate_divergence(torch.nn.Linear(2, 2), torch.ones(1, 2))
            >>> json.loads(json.dumps(report.to_dict()))["agree"]
            True
        """
        out = dataclasses.asdict(self)
        out["agree"] = self.agree
        if self.divergence is not None:
            d = out["divergence"]
            d["shapes"] = [list(s) for s in self.divergence.shapes]
            d["other_shapes"] = [list(s) for s in self.divergence.other_shapes]
            d["index"] = None if self.divergence.index is None else list(self.divergence.index)
            d["location"] = self.divergence.location
        return out

    def __str__(self) -> str:
        d = self.divergence
        if d is None:
            grads = " and gradients" if self.backward else ""
            return (
                f"Runs agree (seed={self.seed}, {self.runs} runs): {self.calls} module calls per "
                f"run; all {self.compared} fingerprints of outputs{grads}, final parameters and "
                "buffers, and the return values are identical."
            )
        forward = f"module call #{d.call_index}, {d.location}"
        if d.kind not in ("call", "missing", "extra"):
            forward += f", forward {d.what}"
        where = {
            "forward": forward,
            "backward": f"{d.location} (call #{d.call_index}), backward: {d.what}",
            "final": f"{d.location}: {d.what}",
            "result": f"the return value at {d.what}",
        }[d.phase]
        lines = [
            f"Runs diverge (seed={self.seed}): run {d.run} differs from run 1 first at {where}"
        ]
        if d.root is not None and d.module is not None:
            lines.append(f"  in model {d.root}; module call order counts from 0")
        if d.shapes:
            lines.append(f"  shapes: {', '.join(map(str, d.shapes))}")
        lines.append(f"  {d.detail}")
        lines.append(f"  {self.compared} earlier fingerprint(s) agree")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Finding:
    kind: str
    event: _Event | None
    other: _Event | None = None
    leaf: int = 0
    detail: str = ""
    what: str = ""
    index: tuple[int, ...] | None = None
    max_abs_diff: float | None = None


def _structural(a: _Run, b: _Run, run: int) -> tuple[int, _Finding] | None:
    """The first module call that differs between the runs' call sequences, if any, with
    its position in run 1's timeline."""
    for index, (x, y) in enumerate(zip(a.structure, b.structure, strict=False)):
        if x != y:
            event = _call_event(index, x)
            detail = f"run 1 called {_label(x)} here, run {run} called {_label(y)}"
            return a.starts[index], _Finding("call", event, detail=detail)
    index = min(len(a.structure), len(b.structure))
    if len(a.structure) > index:
        detail = (
            f"run 1 called {_label(a.structure[index])} here; run {run} made no more module calls"
        )
        return a.starts[index], _Finding(
            "missing", _call_event(index, a.structure[index]), detail=detail
        )
    if len(b.structure) > index:
        detail = (
            f"run {run} called {_label(b.structure[index])} here; run 1 made no more module calls"
        )
        return sum(e.phase != "final" for e in a.events), _Finding(
            "extra", _call_event(index, b.structure[index]), detail=detail
        )
    return None


def _described(event: _Event) -> list[tuple[tuple[int, ...], str]]:
    return list(zip(event.shapes, event.dtypes, strict=True))


def _label(call: tuple[str, str, str]) -> str:
    return f"{call[1] or '(root)'} ({call[2]})"


def _call_event(index: int, call: tuple[str, str, str]) -> _Event:
    root, name, module_type = call
    return _Event(
        ("forward", index), "forward", root, name, module_type, index, "call", (), (), (), ()
    )


def _compare(a: _Run, b: _Run, run: int) -> tuple[_Finding | None, int]:
    """The first difference in run 1's timeline, and how many events agreed before it.

    Timeline: module outputs and gradients as they happened (a call that
    differs in the two call sequences sits where it started), then the return
    value, then the gradients, parameters and buffers after ``fn`` returned.
    """
    later = {e.key: e for e in b.events}
    structural = _structural(a, b, run)
    agreed = 0

    def check(ea: _Event) -> _Finding | None:
        eb = later.pop(ea.key, None)
        if eb is None:
            return _Finding("missing", ea, detail=f"run 1 recorded it, run {run} did not")
        if (ea.paths, ea.shapes, ea.dtypes) != (eb.paths, eb.shapes, eb.dtypes):
            return _Finding(
                "shape",
                ea,
                eb,
                detail=(
                    f"shapes/dtypes differ: {_described(ea)} (run 1) vs "
                    f"{_described(eb)} (run {run})"
                ),
            )
        for leaf, (x, y) in enumerate(zip(a.fingerprints(ea), b.fingerprints(eb), strict=True)):
            if x is not None and y is not None and x != y:
                return _Finding("values", ea, eb, leaf=leaf)
        return None

    def extra(final: bool) -> _Finding | None:
        for eb in b.events:
            if eb.key in later and (eb.phase == "final") == final:
                return _Finding("extra", eb, detail=f"run {run} recorded it, run 1 did not")
        return None

    for position, ea in enumerate(a.events):
        if ea.phase == "final":
            break
        if structural is not None and position == structural[0]:
            return structural[1], agreed
        found = check(ea)
        if found is not None:
            return found, agreed
        agreed += 1
    if structural is not None:
        return structural[1], agreed
    found = extra(final=False)
    if found is not None:
        return found, agreed
    diff = _first_difference(a.result, b.result)
    if diff is not None:
        return _Finding(
            "result",
            None,
            what=diff.path,
            detail=diff.describe("run 1", f"run {run}"),
            index=diff.index,
            max_abs_diff=diff.max_abs_diff,
        ), agreed
    for ea in a.events:
        if ea.phase == "final":
            found = check(ea)
            if found is not None:
                return found, agreed
            agreed += 1
    return extra(final=True), agreed


def _details(
    reruns: tuple[_Run, _Run], leaf: int, numbers: tuple[int, int]
) -> tuple[str, tuple[int, ...] | None, float | None]:
    """Index and size of the difference, from two more runs that kept the tensor."""
    captured = [r.captured for r in reruns]
    if any(c is None or len(c) <= leaf for c in captured):
        return (
            "values differ (the re-runs that would show by how much took another path)",
            None,
            None,
        )
    (path, x), (_, y) = captured[0][leaf], captured[1][leaf]  # type: ignore[index]
    found = _tensor_difference(x, y, path)
    if found is None:
        return (
            "values differ (their fingerprints do), but two re-runs agreed here, so the "
            "difference is intermittent; the max difference is unknown",
            None,
            None,
        )
    left, right = (f"run {n}" for n in numbers)
    return found.describe(left, right), found.index, found.max_abs_diff


def locate_divergence(
    fn: Callable[..., Any],
    /,
    *args: Any,
    seed: int = 0,
    runs: int = 2,
    backward: bool = False,
    warn_only: bool = False,
    reset: Iterable[Any] = (),
    **kwargs: Any,
) -> DivergenceReport:
    """Run ``fn`` ``runs`` times under ``seed``; name the first module call that differs.

    ``fn`` is a model (``locate_divergence(model, x)``) or any function that
    uses modules, such as a whole training step.  Every run is a fresh
    ``deterministic(seed, warn_only=warn_only)`` block with global forward
    hooks that fingerprint each module call's outputs, in call order, on the
    tensors' own devices.  With ``backward=True`` the gradients w.r.t. each
    call's positional tensor inputs and each module's own parameters are
    fingerprinted too (tensor hooks; modules with in-place ops are fine).
    Then the return values are compared exactly, and the parameters and
    buffers of every model seen are fingerprinted once more.

    The first difference in run 1's order is reported: a module's output,
    a gradient, the return value, or a final parameter (for example when only
    the optimizer step is nondeterministic).  On a divergence two more runs
    keep that one tensor, to report the first differing index and the max
    difference.  Modules and optimizers passed as ``fn`` or as direct
    arguments, and the objects in ``reset``, are put back to their state before
    every run and after the last, exactly as :func:`assert_reproducible` does.

    Calls from other threads are ignored; keyword tensor inputs get no
    gradient fingerprints; names are relative to the first model the module
    was found in (a model among the arguments or in ``reset``, else the first
    module called).

    Example:
        >>> import torch
        >>> from deterministic_ctx.locate import locate_divergence
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> report = locate_divergence(model, torch.ones(2, 4))
        >>> report.agree, report.calls
        (True, 4)
    """
    block = deterministic(seed, warn_only=warn_only)
    runs = _check_runs(runs)
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be True or False, got {backward!r}")
    _check_fn(fn)
    objects = _resettable(fn, args, kwargs, reset)
    roots = [o for o in objects if isinstance(o, torch.nn.Module)]
    saved = _SavedState(objects)

    def again(capture: tuple[Any, ...] | None = None) -> _Run:
        saved.load()  # every run after the first starts from the saved state
        return _run(block, fn, args, kwargs, roots, backward=backward, capture=capture)

    try:
        first = _run(block, fn, args, kwargs, roots, backward=backward)
        finding: _Finding | None = None
        agreed = 0
        run = 1
        for run in range(2, runs + 1):
            finding, agreed = _compare(first, again(), run)
            if finding is not None:
                break
        if finding is None:
            return DivergenceReport(block.seed, runs, backward, len(first.structure), agreed, None)
        detail, index, max_abs_diff = finding.detail, finding.index, finding.max_abs_diff
        if finding.kind == "values":
            assert finding.event is not None
            key = finding.event.key
            reruns = (again(key), again(key))
            detail, index, max_abs_diff = _details(reruns, finding.leaf, (runs + 1, runs + 2))
    finally:
        saved.load()
    return DivergenceReport(
        block.seed,
        runs,
        backward,
        len(first.structure),
        agreed,
        _divergence(finding, detail, index, max_abs_diff, run),
    )


def _divergence(
    finding: _Finding,
    detail: str,
    index: tuple[int, ...] | None,
    max_abs_diff: float | None,
    run: int,
) -> Divergence:
    e, other = finding.event, finding.other
    if e is None:  # the return value
        return Divergence(
            "result",
            finding.kind,
            None,
            None,
            None,
            None,
            finding.what,
            (),
            (),
            index,
            max_abs_diff,
            run,
            detail,
        )
    what = e.what
    if finding.kind == "values" and e.phase == "forward" and len(e.paths) > 1:
        what = e.paths[finding.leaf]  # which output of several
    return Divergence(
        e.phase,
        finding.kind,
        e.module,
        e.module_type,
        e.root,
        e.call_index,
        what,
        e.shapes,
        other.shapes if other is not None else (),
        index,
        max_abs_diff,
        run,
        detail,
    )
