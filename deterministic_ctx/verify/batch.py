"""``assert_batch_invariant``: each row of ``fn(batch)`` against ``fn`` called on that row
alone, bit for bit; :class:`BatchInvarianceError` names the first row that differs, with a
hint at the likely cause."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._errors import PUBLIC_MODULE
from .._torch.internals import BATCH_NORM_BASE, DROPOUT_BASE
from ..core.context import deterministic
from .compare import Difference, first_difference, tensor_leaves
from .reproducible import NotReproducibleError, fn_name
from .rerun import call_and_consume, prepare_runs
from .rows import batch_layout, check_dim, check_rows, result_layout, row_of

__all__ = ["BatchInvarianceError", "assert_batch_invariant"]


class BatchInvarianceError(NotReproducibleError):
    """A row of ``fn(batch)`` differs from ``fn`` called on that row alone.

    Raised by :func:`assert_batch_invariant`; a :class:`NotReproducibleError`
    (so an :class:`AssertionError`) with the same ``path``, ``index``,
    ``max_abs_diff`` and ``seed`` attributes (``run`` is ``None``), and:

    * ``row``: the first differing row, an index along the batch's ``dim``;
    * ``dim`` and ``out_dim``: the batch dimension of the inputs and of the result.

    ``path`` names the leaf of the batched result, e.g. ``'result["logits"]'``,
    and ``index`` an element of that leaf: its ``out_dim`` coordinate is ``row``.

    Example:
        >>> err = BatchInvarianceError("differs", path="result", index=(3, 1), row=3)
        >>> isinstance(err, NotReproducibleError), err.path, err.row, err.dim, err.out_dim
        (True, 'result', 3, 0, 0)
    """

    __module__ = PUBLIC_MODULE

    def __init__(
        self,
        message: str,
        *,
        row: int | None = None,
        dim: int = 0,
        out_dim: int = 0,
        **where: Any,
    ) -> None:
        super().__init__(message, **where)  # path, index, max_abs_diff, seed
        self.row = row
        self.dim = dim
        self.out_dim = out_dim


def _modules_hint(objects: list[Any]) -> str:
    """Submodules in training mode that make rows depend on each other or on the batch's shape."""
    notes = []
    for obj in objects:
        if not isinstance(obj, torch.nn.Module):
            continue
        for name, module in obj.named_modules():
            where = type(module).__qualname__ + (f" (submodule {name!r})" if name else "")
            if module.training and isinstance(module, BATCH_NORM_BASE):
                notes.append(
                    f"{where} is in training mode: it normalizes with the batch's statistics"
                )
            elif module.training and isinstance(module, DROPOUT_BASE) and module.p > 0:
                notes.append(f"{where} is in training mode: it draws a mask for the batch's shape")
    if not notes:
        return ""
    return "; ".join(notes[:3]) + ". Call .eval() on the model for inference.\n"


#: A difference within this many epsilons of the row's largest value is rounding.
_ROUNDING_EPS = 256

_KERNEL_HINT = (
    "kernels chosen by batch size round differently: matrix products (BLAS libraries pick "
    "kernels, blocking and split-K by the number of rows; on CPUs one row alone takes a "
    "matrix-vector kernel, so even nn.Linear differs), attention, torch.compile code "
    "specialized per batch size. Batch-invariant kernels are the remedy, or compare with a "
    "tolerance (torch.testing.assert_close)."
)
_REDUCTION_HINT = (
    "rows depend on each other through a reduction over the batch (a mean, norm or softmax "
    "across rows, BatchNorm in training mode), or random ops draw differently for another "
    "batch shape."
)


def _is_rounding(found: Difference, row: torch.Tensor | None) -> bool:
    """Whether ``found`` (values of the one-row view ``row``) differ by rounding only."""
    if found.what != "values" or found.max_abs_diff is None or row is None:
        return False
    if not (row.is_floating_point() or row.is_complex()):
        return False
    magnitude = row.detach().abs().to(torch.float64)
    finite = magnitude[torch.isfinite(magnitude)]
    scale = float(finite.max()) if finite.numel() else 0.0
    return found.max_abs_diff <= _ROUNDING_EPS * torch.finfo(row.dtype).eps * scale


def _cause_hint(found: Difference, row: torch.Tensor | None) -> str:
    """The likely cause of ``found``; ``row`` is the batched leaf's one-row view (``None``
    where ``found`` is not in a batched tensor)."""
    if row is None:
        return (
            "What the result holds besides its batched tensors must be the same for the batch "
            "and for a row alone: leave out what depends on the batch (its size, for one)."
        )
    if _is_rounding(found, row):
        return "Only the last bits differ, so most likely " + _KERNEL_HINT
    if found.what == "values":
        return (
            "The values differ by more than rounding, so most likely "
            + _REDUCTION_HINT
            + " (Rounding differences of kernels chosen by batch size can also grow through "
            "many layers.)"
        )
    return "Each row must be computed on its own: most likely " + _REDUCTION_HINT


def _alone(fn: str, dim: int, row: int) -> str:
    if dim == 0:
        return f"{fn}(batch[{row}:{row + 1}])"
    return f"{fn}(batch.narrow({dim}, {row}, 1))"


def assert_batch_invariant(
    fn: Callable[..., Any],
    batch: Any,
    /,
    *args: Any,
    dim: int = 0,
    out_dim: int | None = None,
    rows: Iterable[int] | None = None,
    seed: int = 0,
    warn_only: bool = False,
    reset: Iterable[Any] = (),
    **kwargs: Any,
) -> Any:
    """Require each row of ``fn(batch, *args, **kwargs)`` to equal, bit for bit, ``fn``
    called on that row alone.

    ``batch`` is ``fn``'s first argument: a tensor, or a tuple, list, dict,
    named tuple or dataclass of tensors (nested; other values in it are passed
    as they are) that all have the same number of rows along ``dim``.  A tuple
    is one argument: ``lambda b: model(*b)`` unpacks it.  Row ``i`` alone is
    ``batch[i:i+1]`` along ``dim`` in every tensor (the dimension kept, of size
    1): a copy in the batch's memory layout, as a request of its own would be,
    made before ``fn`` runs.  ``args`` and ``kwargs`` go unchanged to every call.

    The result must be a tensor, or a structure like the batch's whose tensors
    all have the batch's rows along ``out_dim`` (default: ``dim``).  Row ``i``
    of each is compared with the lone call's bit for bit (dtype, shape and
    device too), and everything else in the result (an int, a string) must be
    equal, as in :func:`assert_reproducible`.

    ``rows`` picks the rows to check (default: all, ``len(batch) + 1`` calls
    in all); ``rows=range(8)`` bounds the cost for a big batch.  Every call is
    a fresh ``deterministic(seed, warn_only=warn_only)`` block, and modules
    and optimizers passed as ``fn``, as direct arguments or in ``reset`` are
    put back to their state before every call and after the last, as in
    :func:`assert_reproducible`.  Grad mode and train/eval modes are the
    caller's: call ``model.eval()`` first, because BatchNorm in training mode
    normalizes over the batch and random ops (dropout) draw for the batch's
    shape, so their rows differ from lone ones although every call starts
    from the same seed.

    Returns ``fn(batch, *args, **kwargs)`` (as the last call left it, where ``fn`` writes into a
    reused output buffer: the rows are compared with a copy). Raises
    :class:`BatchInvarianceError` naming the first differing row (in the order checked), the
    path of the result's leaf, the element and the max absolute difference, with a hint (modules
    in training mode among those reset, then the usual causes); an exception from a lone call is
    that error's cause.  The options are keyword-only (``functools.partial`` passes ``fn``
    arguments of the same names); bad ones raise :class:`TypeError` or :class:`ValueError`
    before ``fn`` runs, and a result not batched along ``out_dim`` raises :class:`ValueError`.

    Example:
        >>> import torch
        >>> from deterministic_ctx import assert_batch_invariant
        >>> x = torch.arange(12.0).reshape(4, 3)
        >>> assert_batch_invariant(lambda b: {"y": b * 2, "n": 1}, x)["y"].shape
        torch.Size([4, 3])
        >>> try:
        ...     assert_batch_invariant(lambda b: b - b.mean(dim=0), x)
        ... except AssertionError as err:
        ...     print(err.row, err.path, err.index)
        0 result (0, 0)
    """
    block = deterministic(seed, warn_only=warn_only)
    objects, saved = prepare_runs(fn, args, kwargs, reset)
    dim = check_dim("dim", dim)
    out_dim = dim if out_dim is None else check_dim("out_dim", out_dim)
    tensors, dims, size = batch_layout(batch, dim)
    checked = check_rows(rows, size)
    name = fn_name(fn)
    # Copied before fn runs: a fn that changes its input in place cannot change
    # the rows through the batch (nor the batch through a row).
    alone_inputs = {i: row_of(batch, tensors, dims, i) for i in checked}
    try:
        with block:
            batched = call_and_consume(fn, (batch, *args), kwargs)
        leaves, result_dims = result_layout(batched, out_dim, size, name)
        leaf_dims = {path: d for (path, _), d in zip(leaves, result_dims, strict=True)}
        result_tensors = [t for _, t in leaves]
        # Copied now: a fn that writes into a reused output buffer would
        # otherwise overwrite the batched rows with the lone ones before the
        # comparison (the check would compare each lone result with itself).
        expected_rows = {i: row_of(batched, result_tensors, result_dims, i) for i in checked}
        for i in checked:
            saved.load()
            alone = _alone(name, dim, i)
            try:
                with block:
                    got = call_and_consume(fn, (alone_inputs.pop(i), *args), kwargs)
            except Exception as exc:
                raise BatchInvarianceError(
                    f"{name} is not batch-invariant with seed={block.seed}: {alone} raised "
                    f"{exc!r} where {name}(batch) returned\n{_modules_hint(objects)}".rstrip(),
                    seed=block.seed,
                    row=i,
                    dim=dim,
                    out_dim=out_dim,
                ) from exc
            expected = expected_rows.pop(i)
            found = first_difference(expected, got)
            if found is not None:
                raise _batch_error(
                    found, expected, name, block.seed, i, dim, out_dim, leaf_dims, objects
                )
        return batched
    finally:
        saved.load()


def _batch_error(
    found: Difference,
    expected: Any,
    name: str,
    seed: int,
    row: int,
    dim: int,
    out_dim: int,
    leaf_dims: Mapping[str, int],
    objects: list[Any],
) -> BatchInvarianceError:
    """The error for ``found``, a difference between ``expected`` (row ``row`` of the
    batched result, tensors as one-row views) and the lone call's result."""
    leaf_dim = leaf_dims.get(found.path)
    if found.index is not None and leaf_dim is not None:
        # The index into the batched leaf, not into its one-row view.
        index = found.index
        found = dataclasses.replace(found, index=(*index[:leaf_dim], row, *index[leaf_dim + 1 :]))
    hint = _modules_hint(objects)
    if found.what == "shape" and leaf_dim is not None:
        hint += (
            f"{name} returned another shape for one row: does it drop or move the batch "
            "dimension when it has size 1 (squeeze(), a view with a fixed batch size)?"
        )
    else:
        hint += _cause_hint(found, dict(tensor_leaves(expected, "result")).get(found.path))
    return BatchInvarianceError(
        f"{name} is not batch-invariant with seed={seed}: row {row} of {name}(batch) "
        f"(dim={dim}, out_dim={out_dim}) differs from {_alone(name, dim, row)} at "
        f"{found.path}: {found.describe('in the batch', 'alone')}\n{hint}",
        path=found.path,
        index=found.index,
        max_abs_diff=found.max_abs_diff,
        seed=seed,
        row=row,
        dim=dim,
        out_dim=out_dim,
    )
