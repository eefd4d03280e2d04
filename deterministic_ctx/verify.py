"""``assert_reproducible``: run a function several times under one seed and compare bit for bit.

Seeding is half of reproducibility; this is the other half.  Each run is a
fresh :class:`~deterministic_ctx.deterministic` block, so every run starts
from the same RNG state and flags, and the caller's own streams are untouched.
Results are compared *exactly*: tensors and arrays by their bit patterns
(NaNs in the same places are equal, ``-0.0`` and ``0.0`` are not), containers
recursively, everything else with ``==``.  The first difference is reported
by its path in the result, e.g. ``result["logits"][3]``.

Modules and optimizers passed to the function are put back to their state
before every run (and after the last), because a training step that updates
its model would otherwise differ from run to run for the wrong reason.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import reprlib
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

from .context import deterministic

__all__ = ["NotReproducibleError", "assert_reproducible"]

_ROOT = "result"
_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60


class NotReproducibleError(AssertionError):
    """Two runs of the same function under the same seed gave different results.

    A subclass of :class:`AssertionError`, so pytest reports it like a failed
    ``assert``.  The attributes say where the runs first differ:

    * ``path``: the path of the first differing leaf, e.g. ``'result["logits"][3]'``;
    * ``index``: the first differing element of that tensor or array (or ``None``);
    * ``max_abs_diff``: the largest absolute difference between differing
      elements (``None`` when not numeric or when only NaNs differ);
    * ``run``: the run that differed from run 1 (2 for the second run);
    * ``seed``: the seed every run started from.

    Example:
        >>> err = NotReproducibleError("differs", path="result[0]", run=2, seed=0)
        >>> isinstance(err, AssertionError), err.path
        (True, 'result[0]')
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        index: tuple[int, ...] | None = None,
        max_abs_diff: float | None = None,
        run: int | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.index = index
        self.max_abs_diff = max_abs_diff
        self.run = run
        self.seed = seed


# --- exact comparison -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Difference:
    """The first place where two values differ (internal; also used by ``locate``)."""

    path: str
    what: str  # "type", "dtype", "shape", "device", "layout", "length", "keys", "values", "value"
    left: str = ""
    right: str = ""
    index: tuple[int, ...] | None = None
    count: int | None = None
    total: int | None = None
    max_abs_diff: float | None = None
    note: str = ""

    def describe(self, left: str = "run 1", right: str = "run 2") -> str:
        if self.what == "values":
            text = (
                f"values differ at index {self.index}: {self.left} ({left}) vs "
                f"{self.right} ({right}); {self.count} of {self.total} element(s) differ"
            )
            if self.max_abs_diff is not None:
                text += f", max abs difference {self.max_abs_diff:.6g}"
        elif self.what == "keys":
            text = f"keys differ: {self.left} ({left}) vs {self.right} ({right})"
        elif self.what == "value":
            text = f"{self.left} ({left}) != {self.right} ({right})"
        else:
            text = f"{self.what} differs: {self.left} ({left}) vs {self.right} ({right})"
        return f"{text}; {self.note}" if self.note else text


def _key_path(key: object) -> str:
    if isinstance(key, str):
        return f"[{json.dumps(key)}]"
    return f"[{key!r}]"


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _children(obj: object) -> list[tuple[str, Any]] | None:
    """``(path suffix, child)`` for a container we recurse into; ``None`` for a leaf."""
    if isinstance(obj, Mapping):
        return [(_key_path(k), v) for k, v in obj.items()]
    if _is_namedtuple(obj):
        return [(f".{name}", getattr(obj, name)) for name in type(obj)._fields]  # type: ignore[attr-defined]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.compare]
    if isinstance(obj, torch.nn.Module):
        return [(f".state_dict()[{json.dumps(k)}]", v) for k, v in obj.state_dict().items()]
    return None


def _tensor_leaves(obj: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` (recursing like the comparison), with its path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    children = _children(obj)
    if children is not None and not isinstance(obj, torch.nn.Module):
        for suffix, child in children:
            yield from _tensor_leaves(child, path + suffix)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return tuple(reversed(index))


_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NATIVE_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t``'s bit pattern (complex: a trailing dim of 2).

    No copy for dense strided tensors; equal bits ⇔ equal views.
    """
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in _NATIVE_INTS:
        return t
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(_SIGNED[t.element_size()])


def _format_scalar(value: Any, dtype: object) -> str:
    if isinstance(value, float):
        small = dtype in (torch.float32, torch.float16, torch.bfloat16, np.float32, np.float16)
        return f"{value:.9g}" if small else repr(value)
    return repr(value)


def _summarize(diff_max: float | None, one_nan: int) -> tuple[float | None, str]:
    """Notes on numeric differences (the differing elements' max abs difference, and how
    many are NaN in one run only); call only for numeric data."""
    notes = []
    if one_nan:
        notes.append(f"{one_nan} element(s) are NaN in only one run")
    if diff_max is not None and diff_max == 0.0 and not one_nan:
        notes.append(
            "the bit patterns differ but the values compare equal (signed zeros or NaN payloads)"
        )
    elif diff_max is None and not one_nan:
        notes.append("only NaN payloads differ")
    return diff_max, "; ".join(notes)


def _tensor_difference(a: torch.Tensor, b: torch.Tensor, path: str) -> _Difference | None:
    metadata: tuple[tuple[str, object, object], ...] = (
        ("dtype", a.dtype, b.dtype),
        ("shape", tuple(a.shape), tuple(b.shape)),
        ("device", a.device, b.device),
        ("layout", a.layout, b.layout),
        ("quantization", a.is_quantized, b.is_quantized),
    )
    for what, x, y in metadata:
        if x != y:
            return _Difference(path, what, str(x), str(y))
    if a.is_meta:
        return None  # no data to compare
    if a.is_quantized:
        return _tensor_difference(a.int_repr(), b.int_repr(), path) or _tensor_difference(
            a.dequantize(), b.dequantize(), path
        )
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    a, b = a.detach().resolve_conj().resolve_neg(), b.detach().resolve_conj().resolve_neg()
    with torch.no_grad():
        neq = _bits(a) != _bits(b)
        if a.is_complex():
            neq = neq.any(dim=-1)
        if not bool(neq.any()):
            return None
        count = int(neq.sum())
        index = _unravel(int(neq.reshape(-1).to(torch.uint8).argmax()), tuple(a.shape))
        left = _format_scalar(a[index].item(), a.dtype)
        right = _format_scalar(b[index].item(), a.dtype)
        try:
            wide = torch.complex128 if a.is_complex() else torch.float64
            da, db = a[neq].to(wide), b[neq].to(wide)
            diff = (da - db).abs()
            nan = torch.isnan(diff)
            finite = diff[~nan]
            diff_max = float(finite.max()) if finite.numel() else None
            one_nan = int((torch.isnan(da) ^ torch.isnan(db)).sum())
        except (RuntimeError, TypeError):  # a dtype without float conversion
            return _Difference(path, "values", left, right, index, count, a.numel())
    diff_max, note = _summarize(diff_max, one_nan)
    return _Difference(path, "values", left, right, index, count, a.numel(), diff_max, note)


def _array_difference(
    a: np.ndarray, b: np.ndarray, path: str, seen: set[tuple[int, int]]
) -> _Difference | None:
    if a.dtype != b.dtype:
        return _Difference(path, "dtype", str(a.dtype), str(b.dtype))
    if a.shape != b.shape:
        return _Difference(path, "shape", str(a.shape), str(b.shape))
    if a.dtype.hasobject:
        for flat, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1), strict=True)):
            index = _unravel(flat, a.shape)
            found = _difference(x, y, f"{path}[{', '.join(map(str, index))}]", seen)
            if found is not None:
                return found
        return None
    if a.dtype.itemsize == 0 or a.size == 0:
        return None
    fa, fb = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    ba = fa.view(np.uint8).reshape(fa.size, a.dtype.itemsize)
    bb = fb.view(np.uint8).reshape(fb.size, b.dtype.itemsize)
    neq = (ba != bb).any(axis=1)
    if not neq.any():
        return None
    flat = int(neq.argmax())
    index = _unravel(flat, a.shape)
    left, right = _format_scalar(fa[flat].item(), a.dtype), _format_scalar(fb[flat].item(), a.dtype)
    count = int(neq.sum())
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):  # structured, str, ...
        return _Difference(path, "values", left, right, index, count, a.size)
    wide = np.complex128 if np.issubdtype(a.dtype, np.complexfloating) else np.float64
    da, db = fa[neq].astype(wide), fb[neq].astype(wide)
    with np.errstate(all="ignore"):
        diff = np.abs(da - db)
    finite = diff[~np.isnan(diff)]
    diff_max, note = _summarize(
        float(finite.max()) if finite.size else None, int((np.isnan(da) ^ np.isnan(db)).sum())
    )
    return _Difference(path, "values", left, right, index, count, a.size, diff_max, note)


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _difference(a: Any, b: Any, path: str, seen: set[tuple[int, int]]) -> _Difference | None:
    if a is b:
        return None
    if type(a) is not type(b):
        return _Difference(path, "type", type(a).__qualname__, type(b).__qualname__)
    if isinstance(a, torch.Tensor):
        return _tensor_difference(a, b, path)
    if isinstance(a, np.ndarray):
        return _array_difference(a, b, path, seen)
    if isinstance(a, np.generic):
        return _array_difference(np.asarray(a), np.asarray(b), path, seen)
    if isinstance(a, float):
        if _float_bits(a) == _float_bits(b):
            return None
        return _Difference(path, "value", repr(a), repr(b))
    if isinstance(a, complex):
        if _float_bits(a.real) + _float_bits(a.imag) == _float_bits(b.real) + _float_bits(b.imag):
            return None
        return _Difference(path, "value", repr(a), repr(b))
    children_a = _children(a)
    if children_a is not None:
        pair = (id(a), id(b))
        if pair in seen:  # a cycle: already being compared further up
            return None
        seen.add(pair)
        children_b = _children(b)
        assert children_b is not None  # same type
        if isinstance(a, Mapping):
            keys_a, keys_b = list(a), list(b)
            if keys_a != keys_b:
                note = "same keys in a different order" if set(keys_a) == set(keys_b) else ""
                return _Difference(path, "keys", _repr.repr(keys_a), _repr.repr(keys_b), note=note)
        elif len(children_a) != len(children_b):
            return _Difference(path, "length", str(len(children_a)), str(len(children_b)))
        for (suffix, x), (_, y) in zip(children_a, children_b, strict=True):
            found = _difference(x, y, path + suffix, seen)
            if found is not None:
                return found
        return None
    try:
        equal = bool(a == b)
    except Exception as exc:
        raise TypeError(
            f"cannot compare {path} of type {type(a).__qualname__}: == raised {exc!r}; "
            "return tensors, arrays, numbers, containers or dataclasses instead"
        ) from exc
    if equal:
        return None
    note = ""
    if cast(Any, type(a)).__eq__ is object.__eq__:
        note = (
            f"{type(a).__qualname__} defines no __eq__, so == compares identity; "
            "return data (tensors, numbers, containers, dataclasses) instead"
        )
    return _Difference(path, "value", _repr.repr(a), _repr.repr(b), note=note)


def _first_difference(a: Any, b: Any, path: str = _ROOT) -> _Difference | None:
    """The first difference between ``a`` and ``b`` in depth-first order, or ``None``."""
    return _difference(a, b, path, set())


# --- putting modules and optimizers back between runs ---------------------------------------


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
            for table, name, original, saved in self._tensors:
                if table.get(name) is not original:
                    table[name] = original  # the run replaced the tensor object
                same = (original.shape, original.dtype, original.device) == (
                    saved.shape,
                    saved.dtype,
                    saved.device,
                )
                if same:
                    original.copy_(saved)
                else:
                    original.data = saved.clone()
            for param, grad in self._grads:
                param.grad = None if grad is None else grad.clone()
        for m, training in self._modes:
            m.training = training


class _StateDictState:
    """Anything with ``state_dict()`` / ``load_state_dict()``: optimizers, schedulers, scalers."""

    __slots__ = ("_obj", "_saved")

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._saved = copy.deepcopy(obj.state_dict())

    def load(self) -> None:
        # A fresh copy each time: optimizers keep the tensors they are given.
        self._obj.load_state_dict(copy.deepcopy(self._saved))


def _is_resettable(obj: object) -> bool:
    return isinstance(obj, torch.nn.Module) or (
        callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _resettable(
    fn: object, args: tuple[Any, ...], kwargs: Mapping[str, Any], reset: Iterable[Any]
) -> list[Any]:
    """Objects to put back before every run: ``reset``, plus modules and optimizers that
    are ``fn`` itself, its ``__self__``, or a direct argument."""
    if isinstance(reset, (str, bytes)) or not isinstance(reset, Iterable):
        raise TypeError(f"reset must be an iterable of modules or optimizers, got {reset!r}")
    explicit = list(reset)
    for obj in explicit:
        if not _is_resettable(obj):
            raise TypeError(
                "reset must contain modules, optimizers or other objects with "
                "state_dict() and load_state_dict(), got "
                f"{type(obj).__qualname__} {_repr.repr(obj)}"
            )
    found: list[Any] = []
    candidates = [fn, getattr(fn, "__self__", None), *args, *kwargs.values()]
    automatic = [o for o in candidates if isinstance(o, (torch.nn.Module, torch.optim.Optimizer))]
    for obj in explicit + automatic:
        if all(obj is not other for other in found):
            found.append(obj)
    return found


class _SavedState:
    __slots__ = ("_states",)

    def __init__(self, objects: Iterable[Any]) -> None:
        self._states = [
            _ModuleState(o) if isinstance(o, torch.nn.Module) else _StateDictState(o)
            for o in objects
        ]

    def load(self) -> None:
        for state in self._states:
            state.load()


# --- running --------------------------------------------------------------------------------


def _check_fn(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__qualname__} {_repr.repr(fn)}")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"fn must be synchronous, got async function {getattr(fn, '__qualname__', fn)!r}; "
            "wrap it, e.g. lambda: asyncio.run(fn())"
        )


def _check_runs(runs: object) -> int:
    if isinstance(runs, bool) or not isinstance(runs, int):
        raise TypeError(f"runs must be an int >= 2, got {type(runs).__name__} {runs!r}")
    if runs < 2:
        raise ValueError(f"runs must be an int >= 2, got {runs}")
    return runs


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """Call ``fn``; consume a returned generator here, inside the caller's block."""
    result = fn(*args, **kwargs)
    if inspect.isgenerator(result):
        return list(result)
    if inspect.iscoroutine(result) or inspect.isasyncgen(result):
        if inspect.iscoroutine(result):
            result.close()  # never awaited: no "coroutine was never awaited" warning
        raise TypeError("fn returned a coroutine or async generator; wrap it, e.g. in asyncio.run")
    return result


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def assert_reproducible(
    fn: Callable[..., Any],
    /,
    *args: Any,
    seed: int = 0,
    runs: int = 2,
    warn_only: bool = False,
    reset: Iterable[Any] = (),
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` ``runs`` times under ``seed`` and require identical results.

    Every run is a fresh ``deterministic(seed, warn_only=warn_only)`` block, so
    each starts from the same RNG state and determinism flags and the caller's
    random state is untouched.  Results are compared exactly: tensors and
    arrays bit for bit (dtype, shape and device too; NaNs in the same places
    are equal), recursively through lists, tuples, dicts, named tuples and
    dataclasses (a returned module through its ``state_dict()``), floats by
    their bits, other objects with ``==``.  A returned generator is consumed
    inside the block.

    Runs must start from the same inputs: modules and optimizers passed as
    ``fn`` or as direct arguments, and the objects in ``reset`` (anything with
    ``state_dict()``/``load_state_dict()``, e.g. an optimizer a closure uses),
    are put back to their state before every run and after the last one.  Other
    arguments are shared by all runs: a function that changes them (a tensor
    updated in place) should build them itself.

    Returns the result of the first run.  Raises :class:`NotReproducibleError`
    naming the first differing path, index and max absolute difference; an
    exception from the first run propagates as is; ``seed``, ``runs``,
    ``warn_only`` and ``reset`` are keyword-only (``functools.partial`` passes
    ``fn`` arguments of the same names).

    Example:
        >>> import torch
        >>> from deterministic_ctx.verify import assert_reproducible
        >>> def init():
        ...     return {"w": torch.randn(3), "n": 1}
        >>> assert_reproducible(init, seed=3)["n"]
        1
        >>> leak = torch.Generator()                  # not managed by the block
        >>> try:
        ...     assert_reproducible(lambda: torch.rand(2, generator=leak))
        ... except AssertionError as err:
        ...     print(err.path, err.index)
        result (0,)
    """
    block = deterministic(seed, warn_only=warn_only)
    runs = _check_runs(runs)
    _check_fn(fn)
    saved = _SavedState(_resettable(fn, args, kwargs, reset))
    try:
        with block:
            first = _call(fn, args, kwargs)
        for run in range(2, runs + 1):
            saved.load()
            try:
                with block:
                    other = _call(fn, args, kwargs)
            except Exception as exc:
                raise NotReproducibleError(
                    f"{_name(fn)} is not reproducible with seed={block.seed}: run {run} of "
                    f"{runs} raised {exc!r} where run 1 returned",
                    run=run,
                    seed=block.seed,
                ) from exc
            found = _first_difference(first, other)
            if found is not None:
                raise NotReproducibleError(
                    f"{_name(fn)} is not reproducible with seed={block.seed}: run {run} of {runs} "
                    f"differs from run 1 at {found.path}: {found.describe('run 1', f'run {run}')}\n"
                    "Randomness the block does not manage (os.urandom, time, an unregistered "
                    "generator: see register_rng) or a nondeterministic operation changed it; "
                    "locate_divergence() finds the first module call where a model diverges.",
                    path=found.path,
                    index=found.index,
                    max_abs_diff=found.max_abs_diff,
                    run=run,
                    seed=block.seed,
                )
        return first
    finally:
        saved.load()
