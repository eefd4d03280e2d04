"""The table behind :func:`~deterministic_ctx.audit.audit_nondeterminism`: aten ops that are
nondeterministic on CUDA, or have no deterministic CUDA kernel, and what
``torch.use_deterministic_algorithms(True)`` does about each.

Data, not logic: one :class:`OpEntry` per case, in :data:`TABLE`.  An entry
names the aten ops it covers (overload packet names: ``"index_put_"`` covers
``aten.index_put_.default`` and ``aten.index_put_.hacked_twin``), the
condition on the call's arguments (a small predicate, and the same condition
in words), the behaviour under deterministic mode (and, where torch changed
it, the behaviour on earlier releases), the phase the op normally runs in, a
note, and a runnable example that the GPU test (``tests/test_audit.py``) runs
on a real CUDA device to check the behaviour.  Entries for one op are tried in
order; the first whose condition holds wins.

The releases it was checked against are :data:`CHECKED_TORCH`; :data:`CHECKS`
says how.  On torch 2.11 every entry's example ran on an NVIDIA H200 (torch
2.11.0+cu130, 2026-11-23) under ``use_deterministic_algorithms(True)`` and
``(True, warn_only=True)``: what it did there is the table's 2.11 behaviour
(an entry's :attr:`~OpEntry.observed`).  On torch 2.13 the behaviours are
read, not run: ``torch/nn/functional.py`` and ``torch/_decomp`` of 2.13.0 (the
Python routes around native kernels), the ``use_deterministic_algorithms``
docstring, and the alert names and kernels present in ``libtorch_cuda.so`` of
the 2.13.0+cu130 wheel (git ``cf30153c``), compared with 2.11.0's (git
``70d99e99``).  Where they disagree, the code wins over the docstring, which
is stale in both releases: it still lists ``cumsum`` and ``ReflectionPad2d``
among the ops that raise, and 2.13's lists ``MaxPool3d`` among those that
become deterministic although only ``F.max_pool3d(return_indices=True)`` does.

What changed between the two releases: ``F.max_pool3d_with_indices``
(``return_indices=True``) on CUDA in deterministic mode computes the pooling
with a decomposition whose backward is deterministic from 2.13 on (absent in
2.12.0's ``functional.py``); the default ``F.max_pool3d`` still calls the
native kernel, which raises.  Entries that differ from torch's docstring, from
the kernels: ``scatter_reduce`` with ``"amax"``/``"amin"`` neither raises nor
warns although its atomic maximum can pick either of ``0.0`` and ``-0.0``;
``index_reduce`` raises for every reduction; ``scatter_(reduce="multiply")``
raises (``scatter_reduce_cuda_kernel``) while ``reduce="add"`` is rerouted to
``index_put_``; ``cumsum`` switches to a deterministic scan;
``ReflectionPad2d`` backward has a deterministic kernel
(``reflection_pad2d_backward_det_out_kernel``), ``ReflectionPad1d``/``3d`` do
not; ``AdaptiveMaxPool3d`` backward accumulates atomically and is not flagged
(``"none"``).

Not listed, because their CUDA kernels are deterministic: ``index_put`` with
``accumulate=True`` (always sorted on CUDA), ``embedding`` backward and
``EmbeddingBag`` backward with ``mode="sum"`` / ``"mean"`` (sorted),
``nll_loss`` on 1-D/2-D input, ``avg_pool2d`` and ``max_pool2d`` backward,
nearest-neighbour upsampling, ``kthvalue`` (no alert since before 2.11, and
ties gave the same indices on the H200), ``cumsum`` along a dimension that is
not the whole tensor, ``scatter_`` with a scalar value (every update is the
same), matmuls (cuBLAS; torch 2.10 dropped the ``CUBLAS_WORKSPACE_CONFIG``
check, see :data:`CUBLAS_CONFIG_CHECKED_BEFORE`).

Example:
    >>> from deterministic_ctx.audit.table import TABLE, entries_for
    >>> [e.key for e in entries_for("put_")]
    ['put', 'put-accumulate']
    >>> all(e.behaviour in ("raise", "warn", "deterministic", "none") for e in TABLE)
    True
    >>> pool = entries_for("max_pool3d_with_indices_backward")[0]
    >>> pool.behaviour_on("2.11.0+cu130"), pool.behaviour_on("2.13.0")
    ('raise', 'deterministic')
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "CHECKED_TORCH",
    "CHECKS",
    "CUBLAS_CONFIG_CHECKED_BEFORE",
    "TABLE",
    "Behaviour",
    "Check",
    "OpCall",
    "OpEntry",
    "entries_for",
    "nearest_checked",
    "release_of",
    "uninitialized_entry",
]

#: The torch releases (major.minor) the table was checked against, oldest first.
CHECKED_TORCH: tuple[str, ...] = ("2.11", "2.13")

#: Up to (not including) this torch release, cuBLAS matmuls raise under deterministic
#: mode unless ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8`` or ``:16:8``; torch 2.10 dropped
#: the check (pytorch#161749), and neither 2.11.0 nor 2.13.0 has its message.
CUBLAS_CONFIG_CHECKED_BEFORE = "2.10"

#: What ``torch.use_deterministic_algorithms(True)`` does on CUDA: ``"raise"`` a
#: ``RuntimeError`` (no deterministic kernel), ``"warn"`` and keep the
#: nondeterministic kernel, switch to a ``"deterministic"`` kernel, or ``"none"``:
#: nothing, the kernel stays nondeterministic without an error or a warning.
Behaviour = Literal["raise", "warn", "deterministic", "none"]
Phase = Literal["forward", "backward"]
#: How a release's behaviours were checked: ``"observed"`` (every example run on a real
#: GPU) or ``"source"`` (read from torch's code, docs and binaries; not run).
How = Literal["observed", "source"]
#: ``"op"``: matched per aten op call; ``"function"``: matched per call of a torch
#: Python function (``ops`` are then qualified function names); ``"uninitialized"``:
#: ops that create uninitialized memory, reported when it is read before written.
Kind = Literal["op", "function", "uninitialized"]


@dataclasses.dataclass(frozen=True)
class Check:
    """How the table was checked against one torch release.

    Example:
        >>> CHECKS[0].release, CHECKS[0].how
        ('2.11', 'observed')
    """

    release: str
    how: How
    what: str

    def describe(self) -> str:
        """``"2.11 (observed on a GPU)"``-style words for reports."""
        how = "observed on a GPU" if self.how == "observed" else "read from source"
        return f"{self.release} ({how})"


#: One per release of :data:`CHECKED_TORCH`, in the same order.
CHECKS: tuple[Check, ...] = (
    Check(
        "2.11",
        "observed",
        "every entry's example run under use_deterministic_algorithms(True) and (True, "
        "warn_only=True) with torch 2.11.0+cu130 (CUDA 13.0, Python 3.12) on an NVIDIA H200, "
        "2026-11-23",
    ),
    Check(
        "2.13",
        "source",
        "torch 2.13.0 (git cf30153c): torch/nn/functional.py, torch/_decomp, the "
        "use_deterministic_algorithms docstring, and the alert names and kernels in "
        "libtorch_cuda.so of the 2.13.0+cu130 wheel, compared with 2.11.0's; not run on a GPU",
    ),
)


def release_of(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string; ``(0, 0)`` when it has none.

    Example:
        >>> release_of("2.11.0+cu130"), release_of("2.13.0a0+gitcf30153"), release_of("2.13")
        ((2, 11), (2, 13), (2, 13))
    """
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or "0")
    except (IndexError, ValueError):
        return (0, 0)


def nearest_checked(version: str) -> Check:
    """The check of ``version``'s release, or else of the newest checked release before it
    (the oldest one for a release older than all of them).

    Example:
        >>> [nearest_checked(v).release for v in ("2.11.0", "2.12.1", "2.14.0", "2.9.1")]
        ['2.11', '2.11', '2.13', '2.11']
    """
    running = release_of(version)
    earlier = [c for c in CHECKS if release_of(c.release) <= running]
    return earlier[-1] if earlier else CHECKS[0]


@dataclasses.dataclass(frozen=True)
class OpCall:
    """One op call as an entry's condition sees it.

    ``op`` is the overload's name (``"aten.index_put_.default"``), ``name`` its
    overload packet's (``"index_put_"``), ``arguments`` the call's arguments by
    their schema names (defaults filled in), ``callers`` the torch Python
    functions on the stack when it was called (for a backward op: when its
    forward op was called), e.g. ``"torch.nn.functional.interpolate"``.

    Example:
        >>> call = OpCall("aten.put_.default", "put_", {"accumulate": True})
        >>> call["accumulate"], call.get("missing")
        (True, None)
    """

    op: str
    name: str
    arguments: Mapping[str, Any]
    callers: frozenset[str] = frozenset()

    def __getitem__(self, name: str) -> Any:
        return self.arguments[name]

    def get(self, name: str, default: Any = None) -> Any:
        """The argument called ``name``, or ``default`` when the op has none."""
        return self.arguments.get(name, default)


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """One case of the table: which ops, when, and what deterministic mode does.

    Attributes:
        key: a short unique name, e.g. ``"put-accumulate"``.
        ops: aten overload packet names (``kind="op"``), or qualified function
            names (``kind="function"``).
        behaviour: under ``use_deterministic_algorithms(True)``, on the newest release
            of :data:`CHECKED_TORCH` and on any release that ``earlier`` does not cover.
        phase: where the op normally runs (``"backward"``: in autograd's
            backward pass, e.g. ``upsample_bilinear2d_backward``).
        note: why it is nondeterministic, and what to do.
        condition: the condition in words (``""``: always).
        when: the condition as a predicate (``None``: always).
        warn_only_behaviour: under ``use_deterministic_algorithms(True,
            warn_only=True)``; ``None`` means ``"warn"`` where ``behaviour`` is
            ``"raise"`` and ``behaviour`` otherwise.
        kind: see :data:`Kind`.
        parameters: for ``kind="function"``, the function's parameter names in
            order, for torch's C functions, which have no signature to bind
            arguments with (``()``: bound with the Python function's signature).
        unless_dispatched: for ``kind="function"``, aten ops (packet names)
            whose dispatch during the call means another entry covers it.
        example: builds tensors on a device and runs the case; returns what it
            computed.  The GPU test checks the behaviour with it.
        earlier: where torch changed the behaviour: ``(release, behaviour)`` pairs,
            oldest first, each the behaviour on torch releases before ``release``
            (``(("2.13", "raise"),)``: raises before 2.13, ``behaviour`` from then on).
        observed: the releases of :data:`CHECKED_TORCH` on which the example ran on a
            real GPU and did what the table says; on the others the behaviour was read
            from torch's source (see :data:`CHECKS`).

    Example:
        >>> entry = entries_for("put_")[0]
        >>> entry.matches(OpCall("aten.put_.default", "put_", {"accumulate": False}))
        True
        >>> entry.behaviour_under(warn_only=True)
        'warn'
        >>> entry.observed
        ('2.11',)
    """

    key: str
    ops: tuple[str, ...]
    behaviour: Behaviour
    phase: Phase
    note: str
    condition: str = ""
    when: Callable[[OpCall], bool] | None = None
    warn_only_behaviour: Behaviour | None = None
    kind: Kind = "op"
    parameters: tuple[str, ...] = ()
    unless_dispatched: tuple[str, ...] = ()
    example: Callable[[torch.device], Any] | None = None
    earlier: tuple[tuple[str, Behaviour], ...] = ()
    observed: tuple[str, ...] = ("2.11",)

    def matches(self, call: OpCall) -> bool:
        """Whether this entry covers ``call``."""
        return call.name in self.ops and (self.when is None or bool(self.when(call)))

    def behaviour_on(self, version: str | None = None) -> Behaviour:
        """What ``use_deterministic_algorithms(True)`` does on torch ``version`` (a
        ``torch.__version__`` string; ``None``: the newest checked release).

        Example:
            >>> entries_for("cumsum")[0].behaviour_on("2.11.0+cu130")
            'deterministic'
        """
        if version is not None:
            running = release_of(version)
            for release, behaviour in self.earlier:
                if running < release_of(release):
                    return behaviour
        return self.behaviour

    def behaviour_under(self, *, warn_only: bool, version: str | None = None) -> Behaviour:
        """What ``use_deterministic_algorithms(True, warn_only=warn_only)`` does on torch
        ``version`` (``None``: the newest checked release)."""
        behaviour = self.behaviour_on(version)
        if not warn_only:
            return behaviour
        if self.warn_only_behaviour is not None:
            return self.warn_only_behaviour
        return "warn" if behaviour == "raise" else behaviour


# --- conditions --------------------------------------------------------------------------------


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


# --- examples (run by the GPU test; each builds its tensors on ``d``) -------------------------


def _grad_of(
    forward: Callable[[torch.Tensor], torch.Tensor], *shape: int
) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        x = torch.randn(*shape, device=d, requires_grad=True)
        out = forward(x)
        (grad,) = torch.autograd.grad(out, x, torch.randn_like(out))
        return grad

    return example


def _ex_index_add(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, 16, device=d).index_add_(0, index, torch.randn(4096, 16, device=d))


def _ex_index_put(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).index_put_((index,), torch.randn(4096, device=d))


def _ex_put(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).put_(index, torch.randn(4096, device=d))


def _ex_put_accumulate(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).put_(index, torch.randn(4096, device=d), accumulate=True)


def _ex_scatter_add(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).scatter_add_(0, index, torch.randn(4096, device=d))


def _ex_scatter_reduce(reduce: str) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        index = torch.randint(0, 4, (4096,), device=d)
        src = torch.rand(4096, device=d) + 0.5
        return torch.ones(4, device=d).scatter_reduce(0, index, src, reduce=reduce)

    return example


def _ex_scatter_reduce_signed_zeros(d: torch.device) -> Any:
    # 0.0 and -0.0 compare equal: which one an atomic maximum keeps depends on the order.
    index = torch.randint(0, 4, (1 << 16,), device=d)
    src = torch.where(torch.rand(1 << 16, device=d) < 0.5, 0.0, -0.0)
    return torch.zeros(4, device=d).scatter_reduce(0, index, src, "amax", include_self=False)


def _ex_scatter(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, device=d).scatter_(0, index, torch.randn(4096, device=d))


def _ex_scatter_old_reduce(reduce: str) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        index = torch.randint(0, 4, (4096,), device=d)
        # Factors near 1, so that a product of ~1000 of them neither overflows nor vanishes.
        src = 1 + torch.randn(4096, device=d) / 100
        with warnings.catch_warnings():  # torch's deprecation of reduce=, not the point here
            warnings.filterwarnings("ignore", message="The reduce argument of torch.scatter")
            return torch.ones(4, device=d).scatter_(0, index, src, reduce=reduce)

    return example


def _ex_index_reduce(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    src = 1 + torch.randn(4096, 8, device=d) / 100
    with warnings.catch_warnings():  # "index_reduce() is in beta": not the point here
        # Only that one: a bare "index_reduce" would also swallow deterministic mode's
        # warning, "index_reduce_cuda does not have a deterministic implementation".
        warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")
        return torch.ones(4, 8, device=d).index_reduce_(0, index, src, "prod")


def _ex_index_copy(d: torch.device) -> Any:
    index = torch.randint(0, 4, (4096,), device=d)
    return torch.zeros(4, 8, device=d).index_copy_(0, index, torch.randn(4096, 8, device=d))


def _ex_bmm_sparse(d: torch.device) -> Any:
    sparse = (torch.rand(2, 64, 64, device=d) > 0.5).float().to_sparse()
    return torch.bmm(sparse, torch.randn(2, 64, 64, device=d))


def _ex_cumsum(d: torch.device) -> Any:
    return torch.randn(4096, device=d).cumsum(0)


def _ex_histc(d: torch.device) -> Any:
    return torch.rand(4096, device=d).histc(bins=10, min=0, max=1)


def _ex_bincount(d: torch.device) -> Any:
    return torch.bincount(
        torch.randint(0, 8, (4096,), device=d), weights=torch.rand(4096, device=d)
    )


def _ex_median(d: torch.device) -> Any:
    return torch.randn(8, 64, device=d).median(1)


def _ex_nll_loss2d(d: torch.device) -> Any:
    target = torch.randint(0, 3, (2, 8, 8), device=d)
    return F.nll_loss(torch.randn(2, 3, 8, 8, device=d).log_softmax(1), target)


def _ex_ctc_loss(d: torch.device) -> Any:
    log_probs = torch.randn(20, 2, 6, device=d).log_softmax(2).detach().requires_grad_()
    targets = torch.randint(1, 6, (2, 5), device=d)
    lengths = torch.tensor([20, 20], device=d), torch.tensor([5, 4], device=d)
    loss = F.ctc_loss(log_probs, targets, *lengths)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return grad


def _ex_embedding_bag_max(d: torch.device) -> Any:
    weight = torch.randn(10, 4, device=d, requires_grad=True)
    out = F.embedding_bag(torch.randint(0, 10, (8, 3), device=d), weight, mode="max")
    (grad,) = torch.autograd.grad(out, weight, torch.randn_like(out))
    return grad


def _ex_max_unpool(d: torch.device) -> Any:
    values = torch.randn(1, 1, 8, 8, device=d)
    indices = torch.zeros(1, 1, 8, 8, dtype=torch.long, device=d)  # all on one place
    return F.max_unpool2d(values, indices, (2, 2), output_size=(16, 16))


def _ex_resize_quantized(d: torch.device) -> Any:
    # Quantized tensors live on the CPU; the check runs wherever the example is run.
    q = torch.quantize_per_tensor(torch.rand(4), 0.1, 10, torch.quint8)
    return tuple(q.resize_((8,)).shape)


def _ex_sdpa(dropout_p: float) -> Callable[[torch.device], Any]:
    def example(d: torch.device) -> Any:
        dtype = torch.float16 if d.type == "cuda" else torch.float32
        q, k, v = (
            torch.randn(2, 4, 128, 64, device=d, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
        return torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    return example


def _ex_multi_head_attention(d: torch.device) -> Any:
    attention = torch.nn.MultiheadAttention(64, 4, dropout=0.25, batch_first=True, device=d)
    x = torch.randn(2, 128, 64, device=d, requires_grad=True)
    out = attention(x, x, x, need_weights=False)[0]
    return torch.autograd.grad(out, [x, *attention.parameters()], torch.randn_like(out))


def _ex_uninitialized(d: torch.device) -> Any:
    return torch.empty(16, device=d) + 1


_SDPA_NOTE = (
    "scaled_dot_product_attention backward on CUDA's fused kernels (flash, memory-efficient, "
    "cuDNN) accumulates gradients with atomics; deterministic mode makes flash and "
    "memory-efficient deterministic and skips cuDNN, while warn_only=True only warns and "
    "keeps them nondeterministic. The math kernel is deterministic."
)
#: The fused attention kernels' forward ops: their backward is the "scaled_dot_product_attention"
#: entry's.
_FUSED_ATTENTION = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
_ATOMIC = "accumulates with atomicAdd on CUDA, so the order of floating-point additions varies"
_NO_KERNEL = "no deterministic CUDA kernel"

#: Every case, in the order they are tried (per op, the first that matches wins).
TABLE: tuple[OpEntry, ...] = (
    # --- indexing, scatter and gather -------------------------------------------------------
    OpEntry(
        "index_add",
        ("index_add", "index_add_"),
        "deterministic",
        "forward",
        f"index_add {_ATOMIC} when an index repeats; deterministic mode accumulates through "
        "a sorted index_put_. Also the backward of index_select and repeat_interleave.",
        condition="self is floating point or complex",
        when=_floating_arg("self"),
        example=_ex_index_add,
    ),
    OpEntry(
        "index_put",
        ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"),
        "deterministic",
        "forward",
        "index_put_ with accumulate=False (x[idx] = values) writes in an unspecified order "
        "when an index repeats, so which value lands varies; deterministic mode sorts the "
        "indices first. accumulate=True is sorted on CUDA anyway.",
        condition="accumulate=False, more than one value, an integer index",
        when=_index_put_races,
        example=_ex_index_put,
    ),
    OpEntry(
        "put",
        ("put_", "put"),
        "raise",
        "forward",
        f"put_ with accumulate=False has {_NO_KERNEL} (nor a CPU one: it raises on every "
        "device); use index_put_ on a flattened view, which has one.",
        condition="accumulate=False",
        when=lambda call: not call.get("accumulate", False),
        example=_ex_put,
    ),
    OpEntry(
        "put-accumulate",
        ("put_", "put"),
        "raise",
        "forward",
        f"put_ with accumulate=True {_ATOMIC}, with {_NO_KERNEL}. Also the backward of "
        "take; index_put_(accumulate=True) on a flattened view is deterministic instead.",
        condition="accumulate=True",
        when=lambda call: bool(call.get("accumulate", False)),
        example=_ex_put_accumulate,
    ),
    OpEntry(
        "scatter_add",
        ("scatter_add", "scatter_add_"),
        "deterministic",
        "forward",
        f"scatter_add {_ATOMIC}; deterministic mode goes through a sorted index_put_. Also "
        "the backward of gather and take_along_dim.",
        condition="self is floating point or complex",
        when=_floating_arg("self"),
        example=_ex_scatter_add,
    ),
    OpEntry(
        "scatter_reduce-sum",
        ("scatter_reduce", "scatter_reduce_"),
        "deterministic",
        "forward",
        f"scatter_reduce with reduce='sum' or 'mean' {_ATOMIC}; deterministic mode goes "
        "through a sorted index_put_.",
        condition="reduce='sum' or 'mean', floating point",
        when=lambda call: call.get("reduce") in ("sum", "mean") and _floating(call.get("self")),
        example=_ex_scatter_reduce("sum"),
    ),
    OpEntry(
        "scatter_reduce-prod",
        ("scatter_reduce", "scatter_reduce_"),
        "raise",
        "forward",
        f"scatter_reduce with reduce='prod' multiplies atomically on CUDA: {_NO_KERNEL}.",
        condition="reduce='prod'",
        when=lambda call: call.get("reduce") == "prod",
        example=_ex_scatter_reduce("prod"),
    ),
    OpEntry(
        "scatter_reduce-amax",
        ("scatter_reduce", "scatter_reduce_"),
        "none",
        "forward",
        "scatter_reduce with reduce='amax' or 'amin' takes an atomic maximum (minimum) on "
        "CUDA: the value is the same in any order, but of equal values such as 0.0 and -0.0 "
        "whichever comes last is kept, so the sign of a zero varies; torch neither reroutes "
        "nor flags it (on an H200, 3 runs under deterministic mode gave 3 results). Integer "
        "values are exact.",
        condition="reduce='amax' or 'amin', floating point",
        when=lambda call: call.get("reduce") in ("amax", "amin") and _floating(call.get("self")),
        example=_ex_scatter_reduce_signed_zeros,
    ),
    OpEntry(
        "index_reduce",
        ("index_reduce", "index_reduce_"),
        "raise",
        "forward",
        f"index_reduce reduces atomically on CUDA with every reduction ('prod', 'mean', "
        f"'amax', 'amin'); {_NO_KERNEL}, torch flags every reduction (index_reduce_cuda; not "
        "in torch's docstring). scatter_reduce with 'sum' or 'mean' has one.",
        example=_ex_index_reduce,
    ),
    OpEntry(
        "scatter-add",
        ("scatter", "scatter_"),
        "deterministic",
        "forward",
        f"scatter_ with reduce='add' {_ATOMIC}; deterministic mode goes through a sorted "
        "index_put_ (not in torch's docstring: from scatter_impl). scatter_add_ is the same "
        "without the deprecated argument.",
        condition="src is a tensor, reduce='add', self is floating point or complex",
        when=lambda call: (
            isinstance(call.get("src"), torch.Tensor) and _reduce_of_floating("add")(call)
        ),
        example=_ex_scatter_old_reduce("add"),
    ),
    OpEntry(
        "scatter-multiply",
        ("scatter", "scatter_"),
        "raise",
        "forward",
        "scatter_ with reduce='multiply' multiplies atomically on CUDA, so the order of "
        f"floating-point products varies; {_NO_KERNEL} (scatter_reduce_cuda_kernel; not in "
        "torch's docstring). A log-sum with scatter_add_ has one.",
        condition="src is a tensor, reduce='multiply', self is floating point or complex",
        when=lambda call: (
            isinstance(call.get("src"), torch.Tensor) and _reduce_of_floating("multiply")(call)
        ),
        example=_ex_scatter_old_reduce("multiply"),
    ),
    OpEntry(
        "scatter",
        ("scatter", "scatter_"),
        "deterministic",
        "forward",
        "scatter_ with a src tensor writes in an unspecified order when an index repeats; "
        "deterministic mode goes through a sorted index_put_.",
        condition="src is a tensor, no reduce",
        when=lambda call: isinstance(call.get("src"), torch.Tensor) and call.get("reduce") is None,
        example=_ex_scatter,
    ),
    OpEntry(
        "index_copy",
        ("index_copy", "index_copy_"),
        "deterministic",
        "forward",
        "index_copy_ copies in an unspecified order when an index repeats; deterministic "
        "mode makes the last copy win (on the CPU too).",
        example=_ex_index_copy,
    ),
    OpEntry(
        "bmm-sparse",
        ("bmm",),
        "deterministic",
        "forward",
        "bmm of a sparse and a dense CUDA tensor uses a nondeterministic cuSPARSE "
        "algorithm; deterministic mode picks a deterministic one.",
        condition="self is sparse",
        when=lambda call: isinstance(call.get("self"), torch.Tensor) and call["self"].is_sparse,
        example=_ex_bmm_sparse,
    ),
    # --- reductions, sorting, histograms --------------------------------------------------------
    OpEntry(
        "cumsum",
        ("cumsum", "cumsum_"),
        "deterministic",
        "forward",
        "cumsum of floating-point or complex values along a dimension that holds every "
        "element (a 1-D tensor) runs as one device-wide scan on CUDA, whose order of "
        "additions varies; deterministic mode switches to a deterministic scan (torch's "
        "docstring still says it raises). Its backward is a cumsum too. Along any other "
        "dimension, and for integers, cumsum is deterministic.",
        condition="floating point or complex (the result's dtype), along a dimension holding "
        "every element",
        when=_cumsum_scans_whole,
        example=_ex_cumsum,
    ),
    OpEntry(
        "histc",
        ("histc",),
        "raise",
        "forward",
        f"histc of floating-point input {_ATOMIC}; {_NO_KERNEL}.",
        condition="floating-point input",
        when=_floating_arg("self"),
        example=_ex_histc,
    ),
    OpEntry(
        "bincount-weights",
        ("bincount",),
        "raise",
        "forward",
        f"bincount with weights {_ATOMIC}; {_NO_KERNEL}. Without weights it counts exactly.",
        condition="weights given",
        when=lambda call: call.get("weights") is not None,
        example=_ex_bincount,
    ),
    OpEntry(
        "median-indices",
        ("median",),
        "raise",
        "forward",
        "median with a dim (values and indices) on CUDA returns any of several equal values' "
        "indices; " + _NO_KERNEL + ". median() of the whole tensor is deterministic.",
        condition="dim given (indices returned)",
        when=lambda call: "dim" in call.arguments,
        example=_ex_median,
    ),
    # --- losses and embeddings ------------------------------------------------------------------
    OpEntry(
        "nll_loss2d",
        ("nll_loss2d_forward", "nll_loss2d"),
        "raise",
        "forward",
        "nll_loss on 3-D or higher input (NLLLoss / CrossEntropyLoss over images or "
        f"sequences) reduces with atomicAdd on CUDA; {_NO_KERNEL}. reduction='none' and "
        "a manual mean avoid it.",
        condition="reduction is 'mean' or 'sum'",
        when=lambda call: call.get("reduction") != 0,
        example=_ex_nll_loss2d,
    ),
    OpEntry(
        "ctc_loss",
        ("_ctc_loss_backward",),
        "raise",
        "backward",
        f"ctc_loss backward {_ATOMIC}; {_NO_KERNEL}, unless CUDA uses cuDNN's CTC (int32 "
        "targets on the CPU, blank=0, target lengths <= 256).",
        example=_ex_ctc_loss,
    ),
    OpEntry(
        "embedding_bag-max",
        ("_embedding_bag_backward", "_embedding_bag_dense_backward"),
        "raise",
        "backward",
        f"EmbeddingBag backward with mode='max' {_ATOMIC}; {_NO_KERNEL}. mode='sum' and "
        "'mean' sort the indices and are deterministic.",
        condition="mode='max'",
        when=lambda call: call.get("mode") == 2,
        example=_ex_embedding_bag_max,
    ),
    # --- pooling and padding --------------------------------------------------------------------
    OpEntry(
        "avg_pool3d",
        ("avg_pool3d_backward",),
        "raise",
        "backward",
        f"AvgPool3d backward {_ATOMIC}; {_NO_KERNEL}.",
        example=_grad_of(lambda x: F.avg_pool3d(x, 3, stride=2), 2, 3, 9, 9, 9),
    ),
    OpEntry(
        "adaptive_avg_pool2d",
        ("_adaptive_avg_pool2d_backward",),
        "raise",
        "backward",
        f"AdaptiveAvgPool2d backward (and F.interpolate(mode='area')) {_ATOMIC}; "
        f"{_NO_KERNEL}. An output size of 1 is a mean, which is deterministic.",
        example=_grad_of(lambda x: F.adaptive_avg_pool2d(x, 3), 2, 3, 8, 8),
    ),
    OpEntry(
        "adaptive_avg_pool3d",
        ("_adaptive_avg_pool3d_backward", "adaptive_avg_pool3d_backward"),
        "raise",
        "backward",
        f"AdaptiveAvgPool3d backward {_ATOMIC}; {_NO_KERNEL}.",
        example=_grad_of(lambda x: F.adaptive_avg_pool3d(x, 3), 2, 3, 8, 8, 8),
    ),
    OpEntry(
        "adaptive_max_pool2d",
        ("adaptive_max_pool2d_backward",),
        "raise",
        "backward",
        f"AdaptiveMaxPool2d backward {_ATOMIC}; {_NO_KERNEL}.",
        example=_grad_of(lambda x: F.adaptive_max_pool2d(x, 3), 2, 3, 8, 8),
    ),
    OpEntry(
        "adaptive_max_pool3d",
        ("adaptive_max_pool3d_backward",),
        "none",
        "backward",
        f"AdaptiveMaxPool3d backward {_ATOMIC} when windows overlap; torch neither reroutes "
        "nor flags it, so it stays nondeterministic under deterministic mode, silently (on an "
        "H200, 3 runs under deterministic mode gave 3 gradients). AdaptiveMaxPool2d raises.",
        example=_grad_of(lambda x: F.adaptive_max_pool3d(x, 3), 2, 3, 8, 8, 8),
    ),
    OpEntry(
        "fractional_max_pool",
        ("fractional_max_pool2d_backward", "fractional_max_pool3d_backward"),
        "raise",
        "backward",
        f"FractionalMaxPool2d/3d backward {_ATOMIC}; {_NO_KERNEL}.",
        example=_grad_of(
            lambda x: F.fractional_max_pool2d(x, 2, output_ratio=(0.5, 0.5)), 2, 3, 8, 8
        ),
    ),
    OpEntry(
        "max_unpool",
        ("max_unpool2d", "max_unpool3d"),
        "raise",
        "forward",
        "MaxUnpool1d/2d/3d write in an unspecified order when indices repeat; no "
        "deterministic kernel on any device (it raises on the CPU too).",
        example=_ex_max_unpool,
    ),
    OpEntry(
        "max_pool3d-F.max_pool3d",
        ("max_pool3d_with_indices_backward",),
        "deterministic",
        "backward",
        f"MaxPool3d backward {_ATOMIC} when windows overlap; from torch 2.13, in "
        "deterministic mode F.max_pool3d(return_indices=True) computes the pooling with a "
        "decomposition whose backward is deterministic. Before 2.13 it raises.",
        condition="called through F.max_pool3d(return_indices=True) (nn.MaxPool3d("
        "return_indices=True))",
        when=_called_from("torch.nn.functional.max_pool3d_with_indices"),
        example=_grad_of(
            lambda x: F.max_pool3d(x, 3, stride=2, return_indices=True)[0], 2, 3, 9, 9, 9
        ),
        earlier=(("2.13", "raise"),),
    ),
    OpEntry(
        "max_pool3d",
        ("max_pool3d_with_indices_backward",),
        "raise",
        "backward",
        f"MaxPool3d backward {_ATOMIC} when windows overlap; {_NO_KERNEL}. From torch 2.13, "
        "F.max_pool3d(..., return_indices=True) avoids it in deterministic mode; the default "
        "(return_indices=False) still runs this kernel, although torch 2.13's docstring lists "
        "MaxPool3d as deterministic.",
        example=_grad_of(lambda x: F.max_pool3d(x, 3, stride=2), 2, 3, 9, 9, 9),
    ),
    OpEntry(
        "reflection_pad2d",
        ("reflection_pad2d_backward",),
        "deterministic",
        "backward",
        f"ReflectionPad2d (F.pad(mode='reflect') padding two dimensions) backward {_ATOMIC}; "
        "deterministic mode switches to a kernel without atomics (pytorch#136241; torch's "
        "docstring still says it raises).",
        example=_grad_of(lambda x: F.pad(x, (2, 3, 2, 3), mode="reflect"), 2, 3, 8, 8),
    ),
    OpEntry(
        "reflection_pad",
        ("reflection_pad1d_backward", "reflection_pad3d_backward"),
        "raise",
        "backward",
        f"ReflectionPad1d/3d (F.pad(mode='reflect') padding one or three dimensions) backward "
        f"{_ATOMIC}; "
        f"{_NO_KERNEL} (ReflectionPad2d has one).",
        example=_grad_of(lambda x: F.pad(x, (2, 3), mode="reflect"), 2, 3, 8),
    ),
    OpEntry(
        "replication_pad-F.pad",
        ("replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward"),
        "deterministic",
        "backward",
        f"ReplicationPad backward {_ATOMIC}; in deterministic mode F.pad(mode='replicate') "
        "computes the padding with an index decomposition whose backward is deterministic.",
        condition="called through F.pad (ReplicationPad1d/2d/3d)",
        when=_called_from("torch.nn.functional.pad"),
        example=_grad_of(lambda x: F.pad(x, (2, 3, 2, 3), mode="replicate"), 2, 3, 8, 8),
    ),
    OpEntry(
        "replication_pad",
        ("replication_pad1d_backward", "replication_pad2d_backward", "replication_pad3d_backward"),
        "raise",
        "backward",
        f"replication_pad*d called directly (not through F.pad) {_ATOMIC} in backward; "
        f"{_NO_KERNEL}. Call F.pad(mode='replicate') instead.",
        example=_grad_of(lambda x: torch.ops.aten.replication_pad2d(x, [2, 3, 2, 3]), 2, 3, 8, 8),
    ),
    # --- interpolation and sampling -------------------------------------------------------------
    OpEntry(
        "upsample-F.interpolate",
        ("upsample_bilinear2d_backward", "upsample_trilinear3d_backward"),
        "deterministic",
        "backward",
        f"bilinear/trilinear upsampling backward {_ATOMIC}; in deterministic mode "
        "F.interpolate computes them with an index decomposition whose backward is "
        "deterministic.",
        condition="called through F.interpolate (nn.Upsample), mode 'bilinear' or 'trilinear'",
        when=_called_from("torch.nn.functional.interpolate"),
        example=_grad_of(
            lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False),
            2,
            3,
            8,
            8,
        ),
    ),
    OpEntry(
        "upsample",
        (
            "upsample_linear1d_backward",
            "upsample_bilinear2d_backward",
            "upsample_bicubic2d_backward",
            "upsample_trilinear3d_backward",
            "_upsample_bilinear2d_aa_backward",
            "_upsample_bicubic2d_aa_backward",
        ),
        "raise",
        "backward",
        f"linear/bicubic (and antialiased) upsampling backward {_ATOMIC}; {_NO_KERNEL}. "
        "F.interpolate avoids it only for bilinear and trilinear without antialias.",
        condition="linear, bicubic or antialiased; or called directly, not through F.interpolate",
        example=_grad_of(
            lambda x: F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=False),
            2,
            3,
            8,
            8,
        ),
    ),
    OpEntry(
        "grid_sample",
        ("grid_sampler_2d_backward", "grid_sampler_3d_backward"),
        "raise",
        "backward",
        f"F.grid_sample backward {_ATOMIC}; {_NO_KERNEL}.",
        example=_grad_of(
            lambda x: F.grid_sample(
                x, torch.rand(2, 8, 8, 2, device=x.device) * 2 - 1, align_corners=False
            ),
            2,
            3,
            8,
            8,
        ),
    ),
    # --- convolutions and attention -------------------------------------------------------------
    OpEntry(
        "convolution",
        ("convolution", "convolution_backward"),
        "deterministic",
        "forward",
        "cuDNN may pick a nondeterministic convolution algorithm (backward ones accumulate "
        "with atomics); deterministic mode, like cudnn.deterministic, picks deterministic "
        "ones. With cudnn.benchmark on, the choice can still change from run to run.",
        example=_grad_of(
            lambda x: F.conv2d(x, torch.randn(8, 3, 3, 3, device=x.device)), 4, 3, 32, 32
        ),
    ),
    OpEntry(
        "scaled_dot_product_attention",
        (
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_flash_attention_backward",
            "_scaled_dot_product_efficient_attention_backward",
            "_scaled_dot_product_cudnn_attention_backward",
            "_flash_attention_backward",
            "_efficient_attention_backward",
        ),
        "deterministic",
        "backward",
        _SDPA_NOTE,
        warn_only_behaviour="warn",
        example=_ex_sdpa(0.0),
    ),
    OpEntry(
        "scaled_dot_product_attention-math",
        ("torch.nn.functional.scaled_dot_product_attention",),
        "deterministic",
        "backward",
        _SDPA_NOTE + " (Here the CPU ran its math kernel, e.g. for dropout_p > 0, where CUDA "
        "runs a fused one.)",
        condition="query, key or value requires grad; no fused kernel ran here",
        when=lambda call: any(
            isinstance(call.get(n), torch.Tensor) and call[n].requires_grad
            for n in ("query", "key", "value")
        ),
        warn_only_behaviour="warn",
        kind="function",
        parameters=(
            "query",
            "key",
            "value",
            "attn_mask",
            "dropout_p",
            "is_causal",
            "scale",
            "enable_gqa",
        ),
        unless_dispatched=_FUSED_ATTENTION,
        example=_ex_sdpa(0.25),
    ),
    OpEntry(
        "multi_head_attention-math",
        ("torch.nn.functional.multi_head_attention_forward",),
        "deterministic",
        "backward",
        _SDPA_NOTE + " (nn.MultiheadAttention and the Transformer layers call it when "
        "need_weights=False; here the CPU ran its math kernel, e.g. for dropout > 0, where "
        "CUDA runs a fused one.)",
        condition="need_weights=False, a tensor requires grad; no fused kernel ran here",
        when=lambda call: (
            not call.get("need_weights", True)
            and any(
                isinstance(v, torch.Tensor) and v.requires_grad for v in call.arguments.values()
            )
        ),
        warn_only_behaviour="warn",
        kind="function",
        unless_dispatched=_FUSED_ATTENTION,
        example=_ex_multi_head_attention,
    ),
    # --- memory ---------------------------------------------------------------------------------
    OpEntry(
        "resize-quantized",
        ("resize_",),
        "raise",
        "forward",
        "resize_ of a quantized tensor leaves the new memory uninitialized and cannot fill "
        "it; it raises on every device.",
        condition="quantized tensor",
        when=lambda call: isinstance(call.get("self"), torch.Tensor) and call["self"].is_quantized,
        example=_ex_resize_quantized,
    ),
    OpEntry(
        "uninitialized",
        (
            "empty",
            "empty_like",
            "empty_strided",
            "empty_permuted",
            "new_empty",
            "new_empty_strided",
            "resize_",
            "resize_as_",
        ),
        "deterministic",
        "forward",
        "memory from torch.empty (or a growing resize_) was read before anything wrote it: "
        "its contents are whatever was there. Deterministic mode fills it with NaN or the "
        "largest integer (torch.utils.deterministic.fill_uninitialized_memory, on by "
        "default); reading it is most likely a bug either way.",
        condition="read before written",
        kind="uninitialized",
        example=_ex_uninitialized,
    ),
)

_BY_NAME: dict[str, tuple[OpEntry, ...]] = {}
for _entry in TABLE:
    if _entry.kind != "uninitialized":
        for _name in _entry.ops:
            _BY_NAME[_name] = (*_BY_NAME.get(_name, ()), _entry)
del _entry, _name


def entries_for(name: str) -> tuple[OpEntry, ...]:
    """The entries (not ``"uninitialized"`` ones) for an aten overload packet name or a
    qualified function name, in the order they are tried; ``()`` when none.

    Example:
        >>> [e.key for e in entries_for("upsample_bilinear2d_backward")]
        ['upsample-F.interpolate', 'upsample']
        >>> entries_for("mm")
        ()
    """
    return _BY_NAME.get(name, ())


def uninitialized_entry() -> OpEntry:
    """The entry for memory read before it was written.

    Example:
        >>> "empty" in uninitialized_entry().ops
        True
    """
    return next(e for e in TABLE if e.kind == "uninitialized")
