"""Fingerprints of tensors: 16 bytes that change when any bit of the data changes.

:func:`~deterministic_ctx.locate.locate_divergence` fingerprints every module
output of a run and compares runs by these fingerprints alone.  They are
computed where the tensor lives, without copying it to the host: two wrapping
int64 sums of its bit pattern, one plain and one weighted by position (so
values that trade places are caught too).

Example:
    >>> import torch
    >>> from deterministic_ctx.fingerprint import fingerprint
    >>> a = torch.arange(6.0)
    >>> plain, weighted = fingerprint(a)
    >>> plain.dtype, plain.shape
    (torch.int64, torch.Size([]))
    >>> fingerprint(a.flip(0))[0] == plain, fingerprint(a.flip(0))[1] == weighted
    (tensor(True), tensor(False))
"""

from __future__ import annotations

import torch

from .compare import bits

__all__ = ["COLUMNS", "fingerprint"]

#: A tensor's bits are read as rows of this many elements.
COLUMNS = 1024
_COLUMN_MIX, _ROW_MIX, _ADD = 0x9E3779B1, 0x85EBCA6B, 0x165667B1
_weights: dict[tuple[torch.device, int], torch.Tensor] = {}


def _mixed(n: int, mix: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * mix + _ADD) & 0x7FFFFFFF) | 1  # odd, below 2**31


def _cached_weights(kind: int, n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` column (``kind`` 0) or row (1) weights on ``device``, cached."""
    w = _weights.get((device, kind))
    if w is None or w.numel() < n:
        size = max(n, COLUMNS)
        size = 1 << (size - 1).bit_length()  # grow by powers of two
        w = _weights[device, kind] = _mixed(size, (_COLUMN_MIX, _ROW_MIX)[kind], device)
    return w[:n]


def fingerprint(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
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

    Example:
        >>> import torch
        >>> fingerprint(torch.zeros(3)) == fingerprint(torch.tensor([0.0, -0.0, 0.0]))
        False
        >>> fingerprint(torch.empty(3, device="meta")) is None
        True
    """
    try:
        if t.is_meta:
            return None
        if t.is_quantized:
            t = t.int_repr()
        elif t.layout != torch.strided:
            t = t.to_dense()
        with torch.no_grad():
            x = bits(t).reshape(-1)
            rows, tail = divmod(x.numel(), COLUMNS)
            device = x.device
            # Integer sums are int64 by default; an explicit dtype= is a slower path.
            if rows == 0:
                return x.sum(), (x * _cached_weights(0, tail, device)).sum()
            table = x[: rows * COLUMNS].view(rows, COLUMNS)
            row_sums = table.sum(dim=1)
            column_sums = table.sum(dim=0)
            plain = row_sums.sum()
            weighted = (row_sums * _cached_weights(1, rows, device)).sum() + (
                column_sums * _cached_weights(0, COLUMNS, device)
            ).sum()
            if tail:
                rest = x[rows * COLUMNS :]
                rest_sum = rest.sum()
                plain = plain + rest_sum
                row_weight = _cached_weights(1, rows + 1, device)[rows]
                weighted = weighted + rest_sum * row_weight
                weighted = weighted + (rest * _cached_weights(0, tail, device)).sum()
            return plain, weighted
    except (RuntimeError, TypeError, ValueError, NotImplementedError, KeyError):
        return None
