"""Exact comparison of results: the first place where two values differ, bit for bit.

Used by :func:`~deterministic_ctx.verify.assert_reproducible` to compare whole
results and by :func:`~deterministic_ctx.verify.locate.locate_divergence` for return
values and single tensors.  Tensors and arrays are compared by their bit
patterns (NaNs in the same places are equal, ``-0.0`` and ``0.0`` are not),
containers recursively, everything else with ``==``.  The first difference in
depth-first order is described by its path, e.g. ``result["logits"][3]``.

Example:
    >>> import torch
    >>> from deterministic_ctx.verify.compare import first_difference
    >>> found = first_difference({"w": torch.zeros(3)}, {"w": torch.tensor([0.0, 1.0, 0.0])})
    >>> found.path, found.index, found.max_abs_diff
    ('result["w"]', (1,), 1.0)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import reprlib
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import torch

__all__ = [
    "Difference",
    "bits",
    "children",
    "first_difference",
    "float_bits",
    "leaves",
    "short_repr",
    "tensor_difference",
    "tensor_leaves",
]

_ROOT = "result"
_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60

#: Pairs ``(id(a), id(b))`` of containers being compared further up: cycles stop there.
_Seen = set[tuple[int, int]]


def short_repr(obj: object) -> str:
    """``repr(obj)`` cut short (about 60 characters, a few items), for error messages.

    Example:
        >>> short_repr(list(range(100)))
        '[0, 1, 2, 3, 4, 5, ...]'
    """
    return _repr.repr(obj)


@dataclasses.dataclass(frozen=True)
class Difference:
    """The first place where two values differ.

    ``what`` names the kind of difference: ``"type"``, ``"dtype"``, ``"shape"``,
    ``"device"``, ``"layout"``, ``"quantization"``, ``"length"``, ``"keys"``,
    ``"values"`` (elements of a tensor or array: ``index`` is the first differing
    one, ``count`` of ``total`` differ) or ``"value"`` (a scalar or object).
    ``left`` and ``right`` show the two sides; ``note`` adds a hint.

    Example:
        >>> d = Difference("result[0]", "value", "1", "2")
        >>> d.describe("run 1", "run 2")
        '1 (run 1) != 2 (run 2)'
    """

    path: str
    what: str
    left: str = ""
    right: str = ""
    index: tuple[int, ...] | None = None
    count: int | None = None
    total: int | None = None
    max_abs_diff: float | None = None
    note: str = ""

    def describe(self, left: str = "run 1", right: str = "run 2") -> str:
        """One sentence, naming the two sides ``left`` and ``right``."""
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


def first_difference(a: Any, b: Any, path: str = _ROOT) -> Difference | None:
    """The first difference between ``a`` and ``b`` in depth-first order, or ``None``.

    Raises :class:`TypeError` when ``==`` raises on two objects of a type this
    does not know (an ambiguous truth value, for instance).

    Example:
        >>> first_difference([1, 2.0], [1, 2.0]) is None
        True
        >>> first_difference([1, 0.0], [1, -0.0]).describe()
        '0.0 (run 1) != -0.0 (run 2)'
    """
    return _difference(a, b, path, set())


def _difference(a: Any, b: Any, path: str, seen: _Seen) -> Difference | None:
    if a is b:
        return None
    if type(a) is not type(b):
        return Difference(path, "type", type(a).__qualname__, type(b).__qualname__)
    return _same_type_difference(a, b, path, seen)


# --- by type: how two values of one type are compared ------------------------------------------
#
# One rule per kind of value (np.ndarray's is _array_difference, further down).  Dispatch
# follows the MRO, so NumPy scalars (np.float64 subclasses float) reach the np.generic rule
# before the float one, as they must: they are compared like arrays.


@functools.singledispatch
def _same_type_difference(a: Any, b: Any, path: str, seen: _Seen) -> Difference | None:
    """Objects of one type without a rule of their own: dataclasses field by field,
    anything else with ``==``."""
    if _is_dataclass_instance(a):
        return _members_difference(a, b, path, seen)
    return _equality_difference(a, b, path)


@_same_type_difference.register(torch.Tensor)
def _tensors(a: torch.Tensor, b: torch.Tensor, path: str, seen: _Seen) -> Difference | None:
    return tensor_difference(a, b, path)


@_same_type_difference.register(np.generic)
def _numpy_scalars(a: np.generic, b: np.generic, path: str, seen: _Seen) -> Difference | None:
    return _array_difference(np.asarray(a), np.asarray(b), path, seen)


def float_bits(x: float | complex) -> bytes:
    if isinstance(x, complex):
        return struct.pack("<dd", x.real, x.imag)
    return struct.pack("<d", x)


@_same_type_difference.register(float)
@_same_type_difference.register(complex)
def _floats(a: float | complex, b: float | complex, path: str, seen: _Seen) -> Difference | None:
    # By their bits, like tensors: the same NaN equals itself, -0.0 differs from 0.0.
    if float_bits(a) == float_bits(b):
        return None
    return Difference(path, "value", repr(a), repr(b))


@_same_type_difference.register(Mapping)
@_same_type_difference.register(list)
@_same_type_difference.register(tuple)
@_same_type_difference.register(torch.nn.Module)
def _members_difference(a: Any, b: Any, path: str, seen: _Seen) -> Difference | None:
    """Containers of one type, member by member in the order ``children`` lists them."""
    pair = (id(a), id(b))
    if pair in seen:  # a cycle: already being compared further up
        return None
    seen.add(pair)
    children_a, children_b = children(a), children(b)
    # Only containers are dispatched here, and a and b are of one type.
    assert children_a is not None
    assert children_b is not None
    if isinstance(a, Mapping):
        keys_a, keys_b = list(a), list(b)
        if keys_a != keys_b:
            note = "same keys in a different order" if set(keys_a) == set(keys_b) else ""
            return Difference(path, "keys", _repr.repr(keys_a), _repr.repr(keys_b), note=note)
    elif len(children_a) != len(children_b):
        return Difference(path, "length", str(len(children_a)), str(len(children_b)))
    for (suffix, x), (_, y) in zip(children_a, children_b, strict=True):
        found = _difference(x, y, path + suffix, seen)
        if found is not None:
            return found
    return None


def _equality_difference(a: object, b: object, path: str) -> Difference | None:
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
    return Difference(path, "value", _repr.repr(a), _repr.repr(b), note=note)


# --- containers ---------------------------------------------------------------------------------


def _key_path(key: object) -> str:
    if isinstance(key, str):
        return f"[{json.dumps(key)}]"
    return f"[{key!r}]"


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def children(obj: object) -> list[tuple[str, Any]] | None:
    """``(path suffix, child)`` for a container we recurse into; ``None`` for a leaf."""
    if isinstance(obj, Mapping):
        return [(_key_path(k), v) for k, v in obj.items()]
    if _is_namedtuple(obj):
        return [(f".{name}", getattr(obj, name)) for name in type(obj)._fields]  # type: ignore[attr-defined]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if _is_dataclass_instance(obj):
        fields = dataclasses.fields(obj)  # type: ignore[arg-type]
        return [(f".{f.name}", getattr(obj, f.name)) for f in fields if f.compare]
    if isinstance(obj, torch.nn.Module):
        return [(f".state_dict()[{json.dumps(k)}]", v) for k, v in obj.state_dict().items()]
    return None


def leaves(obj: object, path: str, _seen: set[int] | None = None) -> Iterator[tuple[str, Any]]:
    """Every leaf of ``obj`` with its path, recursing like :func:`first_difference` (but
    not into modules, which are leaves here); a container met again inside itself is
    left out.

    Example:
        >>> import torch
        >>> [p for p, _ in leaves({"a": [torch.zeros(1), 2], "b": "x"}, "out")]
        ['out["a"][0]', 'out["a"][1]', 'out["b"]']
    """
    members = None if isinstance(obj, (torch.Tensor, torch.nn.Module)) else children(obj)
    if members is None:
        yield path, obj
        return
    seen = set() if _seen is None else _seen
    if id(obj) in seen:  # a cycle: already on the way here
        return
    seen.add(id(obj))
    for suffix, child in members:
        yield from leaves(child, path + suffix, seen)
    seen.discard(id(obj))


def tensor_leaves(obj: object, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors among :func:`leaves`.

    Example:
        >>> import torch
        >>> [p for p, _ in tensor_leaves({"a": [torch.zeros(1), 2, torch.ones(1)]}, "out")]
        ['out["a"][0]', 'out["a"][2]']
    """
    if isinstance(obj, torch.Tensor):  # the common case, an op's argument, without a walk
        yield path, obj
        return
    for where, leaf in leaves(obj, path):
        if isinstance(leaf, torch.Tensor):
            yield where, leaf


# --- tensors and arrays ---------------------------------------------------------------------------


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, rest = divmod(flat, size)
        index.append(rest)
    return tuple(reversed(index))


_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NATIVE_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t``'s bit pattern (complex: a trailing dim of 2).

    No copy for dense strided tensors; equal bits ⇔ equal views.

    Example:
        >>> import torch
        >>> bits(torch.tensor([0.0, -0.0])).tolist()
        [0, -2147483648]
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


def _metadata_difference(
    path: str, pairs: Iterable[tuple[str, object, object]]
) -> Difference | None:
    """The first of ``(what, a's, b's)`` that differs, e.g. ``("dtype", a.dtype, b.dtype)``."""
    for what, x, y in pairs:
        if x != y:
            return Difference(path, what, str(x), str(y))
    return None


def _summarized(values: Difference, diff_max: float | None, one_nan: int) -> Difference:
    """``values`` with the differing elements' max abs difference and notes on it (how many
    are NaN in one run only); only for numeric data."""
    notes = []
    if one_nan:
        notes.append(f"{one_nan} element(s) are NaN in only one run")
    if diff_max is not None and diff_max == 0.0 and not one_nan:
        notes.append(
            "the bit patterns differ but the values compare equal (signed zeros or NaN payloads)"
        )
    elif diff_max is None and not one_nan:
        notes.append("only NaN payloads differ")
    return dataclasses.replace(values, max_abs_diff=diff_max, note="; ".join(notes))


def tensor_difference(a: torch.Tensor, b: torch.Tensor, path: str) -> Difference | None:
    """The first difference between two tensors: metadata, then values bit for bit.

    Example:
        >>> import torch
        >>> tensor_difference(torch.zeros(2), torch.zeros(3), "x").describe()
        'shape differs: (2,) (run 1) vs (3,) (run 2)'
        >>> tensor_difference(torch.zeros(2), torch.tensor([0.0, 0.5]), "x").index
        (1,)
    """
    metadata: tuple[tuple[str, object, object], ...] = (
        ("dtype", a.dtype, b.dtype),
        ("shape", tuple(a.shape), tuple(b.shape)),
        ("device", a.device, b.device),
        ("layout", a.layout, b.layout),
        ("quantization", a.is_quantized, b.is_quantized),
    )
    found = _metadata_difference(path, metadata)
    if found is not None or a.is_meta:  # a meta tensor has no data to compare
        return found
    if a.is_quantized:
        return tensor_difference(a.int_repr(), b.int_repr(), path) or tensor_difference(
            a.dequantize(), b.dequantize(), path
        )
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    a, b = a.detach().resolve_conj().resolve_neg(), b.detach().resolve_conj().resolve_neg()
    with torch.no_grad():
        return _dense_difference(a, b, path)


def _dense_difference(a: torch.Tensor, b: torch.Tensor, path: str) -> Difference | None:
    neq = bits(a) != bits(b)
    if a.is_complex():
        neq = neq.any(dim=-1)
    if not bool(neq.any()):
        return None
    index = _unravel(int(neq.reshape(-1).to(torch.uint8).argmax()), tuple(a.shape))
    left = _format_scalar(a[index].item(), a.dtype)
    right = _format_scalar(b[index].item(), a.dtype)
    values = Difference(path, "values", left, right, index, int(neq.sum()), a.numel())
    try:
        wide = torch.complex128 if a.is_complex() else torch.float64
        da, db = a[neq].to(wide), b[neq].to(wide)
        diff = (da - db).abs()
        finite = diff[~torch.isnan(diff)]
        diff_max = float(finite.max()) if finite.numel() else None
        one_nan = int((torch.isnan(da) ^ torch.isnan(db)).sum())
    except (RuntimeError, TypeError):  # a dtype without float conversion
        return values
    return _summarized(values, diff_max, one_nan)


@_same_type_difference.register(np.ndarray)
def _array_difference(a: np.ndarray, b: np.ndarray, path: str, seen: _Seen) -> Difference | None:
    found = _metadata_difference(path, (("dtype", a.dtype, b.dtype), ("shape", a.shape, b.shape)))
    if found is not None:
        return found
    if a.dtype.hasobject:
        return _object_array_difference(a, b, path, seen)
    if a.dtype.itemsize == 0 or a.size == 0:
        return None
    fa, fb = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    ba = fa.view(np.uint8).reshape(fa.size, a.dtype.itemsize)
    bb = fb.view(np.uint8).reshape(fb.size, b.dtype.itemsize)
    neq = (ba != bb).any(axis=1)
    if not neq.any():
        return None
    flat = int(neq.argmax())
    left, right = _format_scalar(fa[flat].item(), a.dtype), _format_scalar(fb[flat].item(), a.dtype)
    values = Difference(
        path, "values", left, right, _unravel(flat, a.shape), int(neq.sum()), a.size
    )
    if not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):  # structured, str, ...
        return values
    wide = np.complex128 if np.issubdtype(a.dtype, np.complexfloating) else np.float64
    # Widening a signalling NaN warns ("invalid value encountered in cast"):
    # under ``-W error`` that warning would replace the real report.
    with np.errstate(all="ignore"):
        da, db = fa[neq].astype(wide), fb[neq].astype(wide)
        diff = np.abs(da - db)
    finite = diff[~np.isnan(diff)]
    diff_max = float(finite.max()) if finite.size else None
    return _summarized(values, diff_max, int((np.isnan(da) ^ np.isnan(db)).sum()))


def _object_array_difference(
    a: np.ndarray, b: np.ndarray, path: str, seen: _Seen
) -> Difference | None:
    """Arrays of Python objects, element by element like a container."""
    for flat, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1), strict=True)):
        index = _unravel(flat, a.shape)
        found = _difference(x, y, f"{path}[{', '.join(map(str, index))}]", seen)
        if found is not None:
            return found
    return None
