"""Checked reading of plain data: what a snapshot, a checkpoint or a trace file holds.

A saved snapshot is made only of dicts with string keys, lists, ints, floats,
strings and uint8 tensors.  Each source turns its piece back into a captured
state with these readers, and the file formats above the sources (the
snapshot's header, :mod:`~deterministic_ctx.trace`'s file) read theirs with
them too: they check type, shape and range and name the field by its path
(``sources.numpy.state.pos``).  They raise ``ValueError``; the checkpoint
module adds the file's name.  Nothing here calls anything found in the data,
and nothing allocates more than the data already holds.

Not about any source, so not in :mod:`deterministic_ctx.sources`: every layer
that reads saved data uses this module directly (``.importlinter`` allows it).

Example:
    >>> from deterministic_ctx.base import plain
    >>> plain.fields({"seed": 3}, "state", ["seed"])
    {'seed': 3}
    >>> plain.integer(-1, "state.seed", 0, 2**32 - 1)
    Traceback (most recent call last):
    ...
    ValueError: state.seed: expected an int in 0 .. 4294967295, got int -1
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from types import FrameType
from typing import Any

import torch

from .._errors import StateWarning

__all__ = [
    "byte_tensor",
    "fields",
    "flag",
    "integer",
    "integers",
    "mapping",
    "real",
    "shown",
    "text",
    "warn",
]

_DICTS = (dict, OrderedDict)
#: Far above any real state (torch's CPU generator is 5056 bytes), far below trouble.
MAX_TENSOR_BYTES = 1 << 20


def shown(value: object) -> str:
    """How an error shows a bad value: ``repr`` only of plain scalars, whose
    ``repr`` runs no code of the input's (and of a huge int, only its size)."""
    if type(value) is int and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    kind = type(value)
    if kind not in (int, float, str, bool, type(None)):
        return f"a {kind.__name__}"
    text = repr(value)
    return f"{kind.__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def mapping(value: object, path: str) -> dict[str, Any]:
    """``value`` as a dict with string keys.

    Exact types only (``dict``, or the ``OrderedDict`` some checkpoint tools
    make): a subclass could run code from ``keys`` or ``__getitem__``, and a
    key of another type from ``__hash__`` or ``__eq__``.  Iterating an exact
    dict runs none.
    """
    if type(value) not in _DICTS:
        raise ValueError(f"{path}: expected a dict, got {shown(value)}")
    assert isinstance(value, dict)
    for key in value:
        if type(key) is not str:
            raise ValueError(f"{path}: keys must be strings, got {shown(key)}")
    return value


def fields(
    value: object, path: str, required: Iterable[str], optional: Iterable[str] = ()
) -> dict[str, Any]:
    """``value`` as a :func:`mapping` holding every ``required`` key, maybe
    ``optional`` ones, nothing else."""
    value = mapping(value, path)
    need, may = set(required), set(optional)
    missing = sorted(need - value.keys())
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}")
    extra = sorted(map(repr, value.keys() - need - may))
    if extra:
        raise ValueError(f"{path}: unexpected field(s) {', '.join(extra)}")
    return value


def integer(value: object, path: str, lo: int, hi: int) -> int:
    """An ``int`` (not ``bool``) in ``lo .. hi``."""
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{path}: expected an int in {lo} .. {hi}, got {shown(value)}")
    return value


def flag(value: object, path: str) -> bool:
    """``True`` or ``False``."""
    if type(value) is not bool:
        raise ValueError(f"{path}: expected True or False, got {shown(value)}")
    return value


def real(value: object, path: str) -> float:
    """A ``float`` (any: a state that holds ``nan`` must load as it was saved)."""
    if type(value) is not float:
        raise ValueError(f"{path}: expected a float, got {shown(value)}")
    return value


def text(
    value: object, path: str, *, choices: Iterable[str] | None = None, max_len: int = 4096
) -> str:
    """A ``str`` without NUL, at most ``max_len`` long, one of ``choices`` if given."""
    if type(value) is not str or len(value) > max_len or "\0" in value:
        raise ValueError(
            f"{path}: expected a string (at most {max_len} characters), got {shown(value)}"
        )
    if choices is not None:
        allowed = tuple(choices)
        if value not in allowed:
            raise ValueError(f"{path}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def integers(value: object, path: str, length: int, lo: int, hi: int) -> list[int]:
    """A list of exactly ``length`` ints, each in ``lo .. hi``."""
    if type(value) is not list or len(value) != length:
        size = f"of {len(value)}" if type(value) is list else shown(value)
        raise ValueError(f"{path}: expected a list of {length} ints, got {size}")
    for i, item in enumerate(value):
        integer(item, f"{path}[{i}]", lo, hi)
    return value


def byte_tensor(value: object, path: str, *, numel: int | None = None) -> torch.Tensor:
    """A 1-D uint8 tensor (``numel`` long if given) as a fresh CPU copy.

    Any device is accepted (``torch.load(map_location="cuda")`` moves every
    tensor): generator states are set from CPU tensors.
    """
    if type(value) is not torch.Tensor:  # a subclass could run code (``__torch_function__``)
        raise ValueError(f"{path}: expected a uint8 tensor, got {shown(value)}")
    if value.dtype != torch.uint8 or value.dim() != 1 or value.layout != torch.strided:
        raise ValueError(
            f"{path}: expected a 1-D uint8 tensor, got a {value.layout} {value.dtype} "
            f"tensor of shape {tuple(value.shape)}"
        )
    if value.numel() > MAX_TENSOR_BYTES or (numel is not None and value.numel() != numel):
        want = numel if numel is not None else f"at most {MAX_TENSOR_BYTES}"
        raise ValueError(f"{path}: expected {want} bytes, got {value.numel()}")
    try:
        return value.detach().to("cpu", copy=True).contiguous()
    except Exception as exc:  # a meta tensor, a tensor subclass that refuses, ...
        raise ValueError(f"{path}: cannot read the tensor ({exc})") from exc


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn(message: str) -> None:
    """A :class:`~deterministic_ctx.StateWarning` (a ``RuntimeWarning``) attributed to
    the first caller outside this package (the line that called ``Snapshot.load`` or
    ``restore``)."""
    level = 2
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, StateWarning, stacklevel=level)
