"""Fingerprints of tensors: a few integer sums that change when any element changes.

:func:`~deterministic_ctx.verify.locate.locate_divergence` fingerprints every module
output of a run and compares runs by these fingerprints alone.  They are
computed where the tensor lives, without copying it to the host: the tensor's
bytes are read as int64 words laid out in a near-square table, and the
fingerprint is the table's row sums and column sums (wrapping, so exact and
independent of the reduction order).  A small tensor is its own fingerprint
(a copy of its words).

Any single changed element, any two different elements that trade places,
and a sign flip of every element change the fingerprint; so do ``-0.0`` for
``0.0`` and another NaN payload (bits are compared, not values).  Tensors of
one shape and dtype with equal bits have equal fingerprints, on every device
and thread count.

A :class:`FingerprintStore` keeps the fingerprints of a whole run on their
devices and moves them to the host once; given many tensors at once (a
model's parameters after a run), it copies the words kept as they are in one
operation per device rather than one per tensor.

Example:
    >>> import torch
    >>> from deterministic_ctx.verify.fingerprint import fingerprint_parts
    >>> a = torch.arange(1000.0)  # 500 words: 29 rows of 17, then 7 more
    >>> parts = fingerprint_parts(a)
    >>> [(p.dtype, p.numel()) for p in parts]
    [(torch.int64, 29), (torch.int64, 17), (torch.int64, 7)]
    >>> all(map(torch.equal, fingerprint_parts(a.clone()), parts))
    True
    >>> all(map(torch.equal, fingerprint_parts(a.flip(0)), parts))
    False
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

__all__ = ["SMALL", "FingerprintStore", "Slot", "fingerprint_parts"]

#: Tensors of at most this many 8-byte words (2 KiB) are fingerprinted by a copy of their words:
#: one operation, where the table takes two or three.
SMALL = 256

#: Where a fingerprint is in :meth:`FingerprintStore.host`'s data: one device's buffer, and
#: a range of its bytes.
Slot = tuple[int, int, int]


def fingerprint_parts(t: torch.Tensor, *, copy: bool = True) -> list[torch.Tensor] | None:
    """The fingerprint of ``t`` as a few 1-d int64 tensors on its device (``[]`` when empty):
    they change when any element of ``t`` changes.  ``None`` for tensors without readable
    data (meta, or exotic subclasses).

    ``t``'s bytes, in logical element order, are read as ``n`` int64 words
    (the bytes of a last partial word count one by one).  Up to :data:`SMALL`
    words are copied as they are.  More are laid out as a table whose rows
    hold an odd number of elements, about ``sqrt(n)``; the parts are the
    table's row sums (one per word of an element, for 16-byte elements), its
    column sums, and a copy of the words past its last full row.  That is
    ``2 * sqrt(n)`` words: 2 KiB for a tensor of 128 KiB, 16 KiB for 8 MiB.

    Why this is exact: integer sums wrap modulo 2**64 and do not depend on the
    order of the reduction.  A changed word changes its row's sum.  Two
    different elements that trade places change the sums of their rows (by
    opposite amounts) if they are in different rows, else of their columns.
    An element never straddles words, nor a 16-byte one rows, so a change of
    one element, or a swap, always changes some sum, whatever the dtype.  Two
    64-bit sums of the words, one plain and one weighted by position, cannot
    promise this: where an element's sign is a word's top bit, swapping ``x``
    and ``-x`` leaves the plain sum and moves the weighted one by ``2**63``
    times an even number, that is not at all.  Rows of an odd number of
    elements also see a sign flip of every element (``-t``, ``t.conj()``): a
    row then moves by an odd multiple of its lowest sign bit.

    With ``copy=False`` the words that are copied as they are (a small tensor's,
    those past a table's last row) are views of ``t``'s data instead, for a
    caller that copies them all at once while ``t`` is unchanged.

    Example:
        >>> import torch
        >>> [tuple(p.shape) for p in fingerprint_parts(torch.zeros(3000, dtype=torch.float64))]
        [(46,), (65,), (10,)]
    """
    try:
        if t.is_meta:
            return None
        x = t
        if x.is_quantized:
            x = x.int_repr()
        elif x.layout != torch.strided:
            x = x.detach().to_dense()
        if x.is_conj():
            x = x.detach().resolve_conj()
        if x.is_neg():
            x = x.detach().resolve_neg()
        if not x.is_contiguous():
            x = x.detach().contiguous()  # the elements in logical order
        try:
            # No copy, and no autograd graph: an integer view is not differentiable.
            words = x.view(torch.int64)
        except RuntimeError:  # a last dimension of part words, a scalar, an odd start
            flat = x.detach().view(-1)
            if flat.stride(0) != 1:
                # One element with another stride (``c.conj().imag`` of one complex):
                # torch ignores a size-1 dimension's stride, a dtype view does not.
                flat = flat.clone(memory_format=torch.contiguous_format)
            return _bytewise(flat, copy)
        return _word_sums(words, x.element_size(), copy)
    except (RuntimeError, TypeError, ValueError, NotImplementedError, KeyError):
        return None


class FingerprintStore:
    """Fingerprints of many tensors, kept on their devices and moved to the host at the end.

    :meth:`add` fingerprints a tensor where it lives (no host sync) and says
    where its bytes will be; :meth:`host` concatenates each device's
    fingerprints and copies them once.  Used per run by
    :mod:`~deterministic_ctx.verify.record` and per recording by
    :class:`~deterministic_ctx.verify.ops.OpRecorder`; ``add`` runs once per tensor
    recorded, so it does no more than file the parts.

    Example:
        >>> import torch
        >>> store = FingerprintStore()
        >>> slot = store.add(torch.arange(4.0))
        >>> data = store.host()
        >>> len(data[slot[0]][slot[1] : slot[2]])  # 16 bytes: two int64 words
        16
    """

    __slots__ = ("_buffers", "_filled", "_parts")

    def __init__(self) -> None:
        self._buffers: dict[torch.device, int] = {}
        self._parts: list[list[torch.Tensor]] = []
        self._filled: list[int] = []

    def add(self, t: torch.Tensor) -> Slot | None:
        """Fingerprint ``t``; ``(buffer, start, stop)`` of its bytes in :meth:`host`'s data,
        or ``None`` when it has no readable data (meta tensors, exotic subclasses)."""
        parts = fingerprint_parts(t)
        if parts is None:
            return None
        slot = self._file(parts, t.device)
        self._parts[slot[0]] += parts
        return slot

    def _file(self, parts: list[torch.Tensor], device: torch.device) -> Slot:
        """Where ``parts`` (of a tensor on ``device``) go in their device's buffer, made on
        its first fingerprint."""
        device = parts[0].device if parts else device
        buffer = self._buffers.get(device)
        if buffer is None:
            buffer = self._buffers[device] = len(self._parts)
            self._parts.append([])
            self._filled.append(0)
        start = self._filled[buffer]
        self._filled[buffer] = stop = start + 8 * sum(part.numel() for part in parts)
        return buffer, start, stop

    def add_all(self, tensors: Iterable[torch.Tensor]) -> list[Slot | None]:
        """:meth:`add` each of ``tensors``, which nothing changes until this returns.

        The same fingerprints, with the words copied as they are (a small
        tensor's, those past a table's last row) copied in one operation per
        device rather than one per tensor: for many tensors at once, such as a
        model's parameters after a run.

        Example:
            >>> import torch
            >>> store = FingerprintStore()
            >>> slots = store.add_all([torch.zeros(2), torch.empty(0, device="meta")])
            >>> slots[1] is None, store.host()[0] == bytes(8)
            (True, True)
        """
        slots: list[Slot | None] = []
        pieces: dict[int, list[torch.Tensor]] = {}
        for t in tensors:
            parts = fingerprint_parts(t, copy=False)
            if parts is None:
                slots.append(None)
                continue
            slot = self._file(parts, t.device)
            pieces.setdefault(slot[0], []).extend(parts)
            slots.append(slot)
        for buffer, found in pieces.items():
            # One copy of every piece, views of the tensors included: the same bytes as
            # the parts add() keeps, made before anything can change the tensors.
            if found:
                self._parts[buffer].append(torch.cat(found))
        return slots

    def host(self) -> list[bytes]:
        """Every fingerprint's bytes, per device: one concatenation and one copy each
        (the only host sync)."""
        return [torch.cat(parts).cpu().numpy().tobytes() if parts else b"" for parts in self._parts]


def _bytewise(flat: torch.Tensor, copy: bool) -> list[torch.Tensor]:
    """The parts for a 1-d contiguous tensor that cannot be viewed as words as it is:
    the bytes of a last partial word widened one by one, then the whole words."""
    n, rest = divmod(flat.numel() * flat.element_size(), 8)
    raw = flat.view(torch.uint8)
    parts = [raw[8 * n :].to(torch.int64)] if rest else []
    if n:
        head = raw[: 8 * n]
        try:
            words = head.view(torch.int64)
        except RuntimeError:  # the data starts between two words: copy to realign
            words = head.clone().view(torch.int64)
        parts += _word_sums(words, flat.element_size(), copy)
    return parts


def _word_sums(words: torch.Tensor, element: int, copy: bool) -> list[torch.Tensor]:
    """The parts for the contiguous int64 ``words`` of elements of ``element`` bytes (the
    words copied as they are: views, without ``copy``)."""
    n = words.numel()
    if n <= SMALL:
        if not n:
            return []
        flat = words if words.dim() == 1 else words.reshape(-1)
        return [flat.clone() if copy else flat]
    lanes = max(1, element // 8)  # words per element
    rows, columns, per_row = _layout(n, lanes)
    full = rows * columns
    tail: torch.Tensor | None = None
    try:
        # A view that reaches past the tensor's shape, never past its data (the words are
        # contiguous); so does the copy of the last words: one operation, not a slice and
        # its clone.
        table = words.as_strided((rows, columns), (columns, 1))
        if full < n:
            rest = words.storage_offset() + full
            if copy:
                tail = torch.as_strided_copy(words, (n - full,), (1,), rest)
            else:
                tail = words.as_strided((n - full,), (1,), rest)
    except (RuntimeError, NotImplementedError):  # a backend without strides: plain views
        flat = words.reshape(-1)
        table = flat[:full].view(rows, columns)
        if full < n:
            tail = flat[full:].clone() if copy else flat[full:]
    if lanes > 1:  # one row sum per word of the element: (a, b) <-> (b, a) is a change too
        parts = [table.view(rows, per_row, lanes).sum(1).view(-1), table.sum(0)]
    else:
        parts = [table.sum(1), table.sum(0)]
    if tail is not None:
        parts.append(tail)
    return parts


@functools.lru_cache(maxsize=1024)  # shapes repeat from call to call
def _layout(n: int, lanes: int) -> tuple[int, int, int]:
    """``(rows, columns, elements per row)`` of the table of ``n`` words: an odd number of
    elements per row, about ``sqrt``, so that rows and columns are about as many."""
    per_row = (1 << ((n // lanes).bit_length() // 2)) + 1
    columns = lanes * per_row
    return n // columns, columns, per_row
