"""The conditions of the op table's entries: predicates on an :class:`~.model.OpCall`, by
name.  An entry of the data file names its predicate (``"when"``); the same condition in
words is the entry's ``"condition"``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .model import OpCall

__all__ = ["CONDITIONS"]


def _floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _floating_arg(name: str) -> Callable[[OpCall], bool]:
    def condition(call: OpCall) -> bool:
        return _floating(call.get(name))

    return condition


def _index_put_races(call: OpCall) -> bool:
    """``index_put_(accumulate=False)`` writes in an unspecified order when an index
    repeats; a single value, or boolean masks (whose positions never repeat), give
    the same result in any order: exactly torch's test for its sorted kernel."""
    if call.get("accumulate", False):
        return False
    values = call.get("values")
    if not isinstance(values, torch.Tensor) or values.numel() <= 1:
        return False
    indices = [i for i in call.get("indices") or () if i is not None]
    return not all(i.dtype in (torch.bool, torch.uint8) for i in indices)


def _cumsum_scans_whole(call: OpCall) -> bool:
    """A floating-point cumsum along a dimension that holds every element (a 1-D tensor):
    the only case CUDA runs as one device-wide scan, whose order of additions varies;
    along any other dimension each thread sums one row in order."""
    t = call.get("self")
    if not isinstance(t, torch.Tensor) or t.numel() <= 1:
        return False
    # The kernel runs in the result's dtype: ``dtype=`` when given.
    dtype = call.get("dtype") or t.dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        return False
    dim = call.get("dim", 0)
    return bool(t.numel() == t.size(dim))


def _reduce_of_floating(*reduce: str) -> Callable[[OpCall], bool]:
    def condition(call: OpCall) -> bool:
        return call.get("reduce") in reduce and _floating(call.get("self"))

    return condition


def _called_from(function: str) -> Callable[[OpCall], bool]:
    def condition(call: OpCall) -> bool:
        return function in call.callers

    return condition


#: Every predicate an entry may name, by name.
CONDITIONS: Mapping[str, Callable[[OpCall], bool]] = {
    "self-floating": _floating_arg("self"),
    "index_put-races": _index_put_races,
    "accumulate-false": lambda call: not call.get("accumulate", False),
    "accumulate-true": lambda call: bool(call.get("accumulate", False)),
    "reduce-sum-or-mean-floating": _reduce_of_floating("sum", "mean"),
    "reduce-prod": lambda call: call.get("reduce") == "prod",
    "reduce-amax-or-amin-floating": _reduce_of_floating("amax", "amin"),
    "src-tensor-reduce-add-floating": lambda call: (
        isinstance(call.get("src"), torch.Tensor) and _reduce_of_floating("add")(call)
    ),
    "src-tensor-reduce-multiply-floating": lambda call: (
        isinstance(call.get("src"), torch.Tensor) and _reduce_of_floating("multiply")(call)
    ),
    "src-tensor-no-reduce": lambda call: (
        isinstance(call.get("src"), torch.Tensor) and call.get("reduce") is None
    ),
    "self-sparse": lambda call: (
        isinstance(call.get("self"), torch.Tensor) and call["self"].is_sparse
    ),
    "cumsum-scans-whole": _cumsum_scans_whole,
    "weights-given": lambda call: call.get("weights") is not None,
    "dim-given": lambda call: "dim" in call.arguments,
    "reduction-not-none": lambda call: call.get("reduction") != 0,
    "mode-max": lambda call: call.get("mode") == 2,
    "called-from-F.max_pool3d_with_indices": _called_from(
        "torch.nn.functional.max_pool3d_with_indices"
    ),
    "called-from-F.pad": _called_from("torch.nn.functional.pad"),
    "called-from-F.interpolate": _called_from("torch.nn.functional.interpolate"),
    "query-key-or-value-requires-grad": lambda call: any(
        isinstance(call.get(n), torch.Tensor) and call[n].requires_grad
        for n in ("query", "key", "value")
    ),
    "no-weights-and-requires-grad": lambda call: (
        not call.get("need_weights", True)
        and any(isinstance(v, torch.Tensor) and v.requires_grad for v in call.arguments.values())
    ),
    "self-quantized": lambda call: (
        isinstance(call.get("self"), torch.Tensor) and call["self"].is_quantized
    ),
}
