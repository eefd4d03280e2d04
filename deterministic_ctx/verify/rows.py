"""The rows of a batch and of a batched result, for :func:`~.batch.assert_batch_invariant`:
their layout (the tensors, their batch dimensions, the number of rows), the rows to check,
and one row alone, rebuilt in the batch's structure."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .compare import children, short_repr, tensor_leaves

__all__ = ["batch_layout", "check_dim", "check_rows", "result_layout", "row_of"]


_STRUCTURES = "a tuple, list, dict, named tuple or dataclass"


def check_dim(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int, got {type(value).__qualname__} {short_repr(value)}"
        )
    return value


def _leaf_dim(name: str, dim: int, path: str, tensor: torch.Tensor) -> int:
    """``dim`` as a non-negative dimension of ``tensor`` (the leaf at ``path``)."""
    ndim = tensor.dim()
    if not -ndim <= dim < ndim:
        accepted = (
            f"-{ndim} to {ndim - 1}" if ndim else "none: a 0-dim tensor has no batch dimension"
        )
        raise ValueError(
            f"{name}={dim} is out of range for {path} of shape {tuple(tensor.shape)} "
            f"(accepted: {accepted})"
        )
    return dim % ndim


def batch_layout(batch: object, dim: int) -> tuple[list[torch.Tensor], list[int], int]:
    """The batch's tensors (in :func:`tensor_leaves` order), the dimension of each that ``dim``
    names, and the number of rows they share."""
    leaves = list(tensor_leaves(batch, "batch"))
    if not leaves:
        got = f"{type(batch).__qualname__} {short_repr(batch)}"
        hint = ""
        if isinstance(batch, np.ndarray):
            got = f"ndarray of shape {batch.shape}"
            hint = "; convert arrays with torch.from_numpy"
        raise TypeError(
            f"batch must be a tensor or {_STRUCTURES} of tensors batched along dim, got "
            f"{got}, which holds no tensor{hint}"
        )
    dims = [_leaf_dim("dim", dim, path, t) for path, t in leaves]
    (first, first_tensor), first_dim = leaves[0], dims[0]
    size = first_tensor.shape[first_dim]
    for (path, t), d in zip(leaves, dims, strict=True):
        if t.shape[d] != size:
            raise ValueError(
                f"every tensor in batch must have the same size along dim={dim}: {first} has "
                f"{size} rows (shape {tuple(first_tensor.shape)}), {path} has {t.shape[d]} "
                f"(shape {tuple(t.shape)})"
            )
    if size == 0:
        raise ValueError(
            f"batch has no rows: {first} has size 0 along dim={dim} (shape "
            f"{tuple(first_tensor.shape)}); pass a batch of at least one row"
        )
    return [t for _, t in leaves], dims, size


def result_layout(
    result: object, out_dim: int, size: int, name: str
) -> tuple[list[tuple[str, torch.Tensor]], list[int]]:
    """The batched result's tensors with their paths, and the dimension of each that
    ``out_dim`` names; every one must hold the batch's ``size`` rows."""
    leaves = list(tensor_leaves(result, "result"))
    if not leaves:
        raise ValueError(
            f"{name}(batch) returned {type(result).__qualname__} {short_repr(result)}, which "
            f"holds no tensor: fn must return a tensor or {_STRUCTURES} of tensors batched "
            "along out_dim"
        )
    dims = []
    for path, t in leaves:
        # A value of the whole batch (a 0-dim loss) has no out_dim: the same error.
        if not (-t.dim() <= out_dim < t.dim() and t.shape[out_dim] == size):
            raise ValueError(
                f"{name}(batch) is not batched along out_dim={out_dim}: {path} has shape "
                f"{tuple(t.shape)}, not the batch's {size} rows along out_dim; pass out_dim= "
                "where the rows are another dimension, and leave out values computed over "
                "the whole batch (a mean loss): they cannot be batch-invariant"
            )
        d = out_dim % t.dim()
        dims.append(d)
    return leaves, dims


def check_rows(rows: object, size: int) -> list[int]:
    """The rows to check, non-negative and each once, in the order given."""
    if rows is None:
        return list(range(size))
    if isinstance(rows, (str, bytes, torch.Tensor)) or not isinstance(rows, Iterable):
        raise TypeError(
            f"rows must be None (every row) or an iterable of ints such as range(8), got "
            f"{type(rows).__qualname__} {short_repr(rows)}"
        )
    checked: list[int] = []
    seen: set[int] = set()
    for row in rows:
        if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)):
            raise TypeError(f"rows must contain ints, got {type(row).__qualname__} {row!r:.60}")
        if not -size <= row < size:
            raise ValueError(
                f"rows has {row}, out of range for a batch of {size} row(s) (accepted: "
                f"{-size} to {size - 1})"
            )
        index = int(row) % size
        if index not in seen:
            seen.add(index)
            checked.append(index)
    if not checked:
        raise ValueError("rows must name at least one row, got an empty iterable")
    return checked


def _rebuilt(obj: Any, old: list[Any], new: list[Any]) -> Any:
    """``obj`` (a container whose members, in ``_with_tensors`` order, are ``old``) with
    ``new`` members instead; ``obj`` itself when none changed."""
    if all(a is b for a, b in zip(old, new, strict=True)):
        return obj
    kind: Any = type(obj)
    try:
        if isinstance(obj, Mapping):
            if kind in (dict, OrderedDict):
                return kind(zip(obj.keys(), new, strict=True))
            # defaultdict, transformers' ModelOutput, ...: a copy keeps what the
            # constructor would need (a default factory, the fields).
            mapping: Any = copy.copy(obj)
            for key, value in zip(obj.keys(), new, strict=True):
                mapping[key] = value
            return mapping
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):
            return kind._make(new)
        if isinstance(obj, (list, tuple)):
            return kind(new)
        # A dataclass: a copy, so that fields without init and frozen ones survive.
        instance = copy.copy(obj)
        fields = [f for f in dataclasses.fields(obj) if f.compare]  # as children() lists them
        for field, value in zip(fields, new, strict=True):
            object.__setattr__(instance, field.name, value)
        return instance
    except Exception as exc:
        raise TypeError(
            f"cannot rebuild a {type(obj).__qualname__} with one row of its tensors: {exc!r}; "
            f"batches and results must be tensors or {_STRUCTURES} of them"
        ) from exc


def _with_tensors(obj: Any, new: Iterator[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by the next of ``new``.

    Walks exactly the tensors :func:`tensor_leaves` lists, in its order
    (containers as :func:`first_difference` recurses into them, not modules),
    so the n-th of ``new`` replaces the n-th leaf that it lists.
    """
    if isinstance(obj, torch.Tensor):
        return next(new)
    found = None if isinstance(obj, torch.nn.Module) else children(obj)
    if found is None:
        return obj
    old = [member for _, member in found]
    return _rebuilt(obj, old, [_with_tensors(member, new) for member in old])


def row_of(obj: Any, tensors: list[torch.Tensor], dims: list[int], row: int) -> Any:
    """Row ``row`` of every tensor in ``obj`` (the batch dimension kept, of size 1), copied:
    neither changes the other afterwards."""
    parts = [t.narrow(d, row, 1).clone() for t, d in zip(tensors, dims, strict=True)]
    found = iter(parts)
    rebuilt = _with_tensors(obj, found)
    assert next(found, None) is None, "a tensor of the structure was not replaced"
    return rebuilt
