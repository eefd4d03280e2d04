"""Running a function again from the same start: checked arguments, saved inputs, one call.

:func:`~deterministic_ctx.verify.assert_reproducible` and
:func:`~deterministic_ctx.verify.locate.locate_divergence` both call ``fn`` several
times and need every run to start from the same inputs.  Modules and
optimizers passed to ``fn`` are saved once and put back before every run (and
after the last), because a training step that updates its model would
otherwise differ from run to run for the wrong reason.

Example:
    >>> import torch
    >>> from deterministic_ctx.verify.rerun import SavedState, objects_to_reset
    >>> model = torch.nn.Linear(2, 1)
    >>> saved = SavedState(objects_to_reset(model, (), {}, ()))
    >>> before = model.weight.clone()
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1)
    >>> saved.load()
    >>> torch.equal(model.weight, before)
    True
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._torch.internals import foreach_copy_
from ..internal import check_bool
from .compare import short_repr

__all__ = [
    "SavedState",
    "call_and_consume",
    "check_fn",
    "check_runs",
    "exempted_since",
    "objects_to_reset",
    "prepare_runs",
    "suspects",
]


def exempted_since(before: Mapping[str, int]) -> tuple[str, ...]:
    """The ops that ran exempted from the deterministic check (``allow_nondeterministic``)
    since ``exempted_calls()`` returned ``before``, sorted."""
    from ..internal import exempted_calls

    after = exempted_calls()
    return tuple(sorted(op for op, n in after.items() if n > before.get(op, 0)))


def suspects(ops: tuple[str, ...], run: int) -> str:
    """A line naming the exempted ops that ran in ``run`` as suspects ("" for none)."""
    if not ops:
        return ""
    return (
        f"Suspect: {', '.join(ops)} ran in run {run} exempted from the deterministic check "
        "(allow_nondeterministic): an exempted op may give different results on every run."
    )


def check_fn(fn: object) -> None:
    """Raise :class:`TypeError` unless ``fn`` is a synchronous callable.

    Example:
        >>> check_fn(len)
        >>> check_fn(3)
        Traceback (most recent call last):
        TypeError: fn must be callable, got int 3
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__qualname__} {short_repr(fn)}")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"fn must be synchronous, got async function {getattr(fn, '__qualname__', fn)!r}; "
            "wrap it, e.g. lambda: asyncio.run(fn())"
        )


def prepare_runs(
    fn: object,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    reset: Iterable[Any],
    **flags: object,
) -> tuple[list[Any], SavedState]:
    """The checked start of every check that runs ``fn``: ``fn`` a synchronous callable
    (:func:`check_fn`), each of ``flags`` True or False, and the objects to put back
    between runs (:func:`objects_to_reset`), with their state saved now."""
    check_fn(fn)
    for name, value in flags.items():
        check_bool(value, name)
    objects = objects_to_reset(fn, args, kwargs, reset)
    return objects, SavedState(objects)


def check_runs(runs: object) -> int:
    """``runs`` if it is an int >= 2; else :class:`TypeError` or :class:`ValueError`.

    Example:
        >>> check_runs(3)
        3
        >>> check_runs(1)
        Traceback (most recent call last):
        ValueError: runs must be an int >= 2, got 1
    """
    if isinstance(runs, bool) or not isinstance(runs, int):
        raise TypeError(f"runs must be an int >= 2, got {type(runs).__name__} {runs!r}")
    if runs < 2:
        raise ValueError(f"runs must be an int >= 2, got {runs}")
    return runs


def call_and_consume(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Any:
    """Call ``fn``; consume a returned generator here, so that it runs inside the caller's block.

    Example:
        >>> call_and_consume(lambda n: (i * i for i in range(n)), (3,), {})
        [0, 1, 4]
    """
    result = fn(*args, **kwargs)
    if inspect.isgenerator(result):
        return list(result)
    if inspect.iscoroutine(result) or inspect.isasyncgen(result):
        if inspect.iscoroutine(result):
            result.close()  # never awaited: no "coroutine was never awaited" warning
        raise TypeError("fn returned a coroutine or async generator; wrap it, e.g. in asyncio.run")
    return result


# --- putting modules and optimizers back between runs ---------------------------------------


def _is_resettable(obj: object) -> bool:
    return isinstance(obj, torch.nn.Module) or (
        callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def objects_to_reset(
    fn: object, args: tuple[Any, ...], kwargs: Mapping[str, Any], reset: Iterable[Any]
) -> list[Any]:
    """Objects to put back before every run: ``reset``, plus modules and optimizers that
    are ``fn`` itself, its ``__self__``, or a direct argument; each object once.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> objects_to_reset(model, (torch.ones(2), model), {}, ()) == [model]
        True
    """
    if isinstance(reset, (str, bytes)) or not isinstance(reset, Iterable):
        raise TypeError(f"reset must be an iterable of modules or optimizers, got {reset!r}")
    explicit = list(reset)
    for obj in explicit:
        if not _is_resettable(obj):
            raise TypeError(
                "reset must contain modules, optimizers or other objects with "
                "state_dict() and load_state_dict(), got "
                f"{type(obj).__qualname__} {short_repr(obj)}"
            )
    found: list[Any] = []
    candidates = [fn, getattr(fn, "__self__", None), *args, *kwargs.values()]
    automatic = [o for o in candidates if isinstance(o, (torch.nn.Module, torch.optim.Optimizer))]
    for obj in explicit + automatic:
        if all(obj is not other for other in found):
            found.append(obj)
    return found


#: Lazy modules' parameters before their first call (absent from old torch: nothing matches).
_UNINITIALIZED = getattr(torch.nn.parameter, "UninitializedTensorMixin", ())


class _ModuleState:
    """Values, identities and gradients of a module's tensors, and its train/eval flags."""

    __slots__ = ("_grads", "_modes", "_tensors")

    def __init__(self, module: torch.nn.Module) -> None:
        self._tensors: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
        self._grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._modes = [(m, m.training) for m in module.modules()]
        with torch.no_grad():
            for m in module.modules():
                for table in (m._parameters, m._buffers):
                    for name, t in table.items():
                        if t is None:
                            continue
                        if isinstance(t, _UNINITIALIZED):
                            raise ValueError(
                                f"cannot save the state of {type(module).__qualname__} to reset it "
                                f"between runs: {type(m).__qualname__}.{name} is an uninitialized "
                                "lazy parameter; call the module once on a dummy batch first, or "
                                "build it inside fn"
                            )
                        self._tensors.append((table, name, t, t.detach().clone()))
                        if isinstance(t, torch.nn.Parameter):
                            grad = t.grad
                            self._grads.append((t, None if grad is None else grad.detach().clone()))

    def load(self) -> None:
        with torch.no_grad():
            into: list[torch.Tensor] = []
            out_of: list[torch.Tensor] = []
            for table, name, original, saved in self._tensors:
                if table.get(name) is not original:
                    table[name] = original  # the run replaced the tensor object
                same = (original.shape, original.dtype, original.device) == (
                    saved.shape,
                    saved.dtype,
                    saved.device,
                )
                if same:
                    into.append(original)
                    out_of.append(saved)
                else:
                    original.data = saved.clone()
            _copy_all(into, out_of)
            for param, grad in self._grads:
                param.grad = None if grad is None else grad.clone()
        for m, training in self._modes:
            m.training = training


_foreach_copy: Any = foreach_copy_


def _copy_all(into: list[torch.Tensor], out_of: list[torch.Tensor]) -> None:
    """``into[i].copy_(out_of[i])`` for every i, in as few operations as torch allows:
    a model's parameters and buffers are put back before every run after the first
    (one kernel per device and dtype on a GPU instead of one per tensor)."""
    if not into:
        return
    if _foreach_copy is not None:
        try:
            _foreach_copy(into, out_of)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # a mix it does not take (a tensor subclass, say): every copy again, one by one
    for t, saved in zip(into, out_of, strict=True):
        t.copy_(saved)


class _StateDictState:
    """Anything with ``state_dict()`` / ``load_state_dict()``: optimizers, schedulers, scalers."""

    __slots__ = ("_obj", "_saved")

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._saved = copy.deepcopy(obj.state_dict())

    def load(self) -> None:
        # A fresh copy each time: optimizers keep the tensors they are given.
        self._obj.load_state_dict(copy.deepcopy(self._saved))


class SavedState:
    """The state of some modules and optimizers, saved now; :meth:`load` puts it back.

    Modules keep the identity of their parameters and buffers (an optimizer
    holding them still works) and get their gradients and train/eval flags
    back; other objects go through ``state_dict()`` / ``load_state_dict()``.
    See the module's example.
    """

    __slots__ = ("_states",)

    def __init__(self, objects: Iterable[Any]) -> None:
        self._states = [
            _ModuleState(o) if isinstance(o, torch.nn.Module) else _StateDictState(o)
            for o in objects
        ]

    def load(self) -> None:
        """Put every saved object back to its state when this was made; may be called often."""
        for state in self._states:
            state.load()
