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

``assert_compiled_matches_eager`` compares the other way round: the same
function eagerly and compiled with ``torch.compile``, under one seed, with
the same exact comparison; see its docstring for what makes the two equal.

``assert_batch_invariant`` compares across batch sizes: each row of
``fn(batch)`` against ``fn`` called on that row alone, with the same seed.

The comparison is :mod:`.compare`'s and the resetting :mod:`.rerun`'s, both
shared with :func:`~deterministic_ctx.locate.locate_divergence`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ..compare import Difference, first_difference, short_repr, tensor_leaves
from ..context import deterministic
from ..internal import CompiledRng, unchanged_config
from ..rerun import SavedState, call_and_consume, check_fn, check_runs, objects_to_reset

__all__ = [
    "BatchInvarianceError",
    "CompiledMismatchError",
    "NotReproducibleError",
    "assert_batch_invariant",
    "assert_compiled_matches_eager",
    "assert_reproducible",
]


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
    runs = check_runs(runs)
    check_fn(fn)
    saved = SavedState(objects_to_reset(fn, args, kwargs, reset))
    try:
        with block:
            first = call_and_consume(fn, args, kwargs)
        for run in range(2, runs + 1):
            saved.load()
            try:
                with block:
                    other = call_and_consume(fn, args, kwargs)
            except Exception as exc:
                raise NotReproducibleError(
                    f"{_name(fn)} is not reproducible with seed={block.seed}: run {run} of "
                    f"{runs} raised {exc!r} where run 1 returned",
                    run=run,
                    seed=block.seed,
                ) from exc
            found = first_difference(first, other)
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


# --- compiled against eager ----------------------------------------------------------------------


class CompiledMismatchError(NotReproducibleError):
    """A function compiled with ``torch.compile`` gave other results than it does eagerly.

    Raised by :func:`assert_compiled_matches_eager`; a :class:`NotReproducibleError`
    (so an :class:`AssertionError`) with the same ``path``, ``index``,
    ``max_abs_diff`` and ``seed`` attributes (``run`` is ``None``), and:

    * ``compiled_rng``: the check's ``compiled_rng`` (``"eager"`` or ``None``);
    * ``backend``: the ``torch.compile`` backend, e.g. ``"inductor"``.

    Example:
        >>> err = CompiledMismatchError("differs", path="result[0]", seed=0, compiled_rng=None)
        >>> isinstance(err, NotReproducibleError), err.path, err.compiled_rng, err.backend
        (True, 'result[0]', None, 'inductor')
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        index: tuple[int, ...] | None = None,
        max_abs_diff: float | None = None,
        seed: int | None = None,
        compiled_rng: CompiledRng = "eager",
        backend: str | Callable[..., Any] = "inductor",
    ) -> None:
        super().__init__(message, path=path, index=index, max_abs_diff=max_abs_diff, seed=seed)
        self.compiled_rng = compiled_rng
        self.backend = backend


def _check_not_compiled(fn: object) -> None:
    """``fn`` is the eager function: a compiled one would make the eager run compiled too."""
    if isinstance(fn, torch.nn.Module) and getattr(fn, "_compiled_call_impl", None) is not None:
        raise TypeError(
            f"fn must be an eager module, got {type(fn).__qualname__} compiled in place with "
            "Module.compile(); pass a module that is not compiled: the check compiles it itself"
        )
    if str(getattr(fn, "_torchdynamo_disable_msg", "")).startswith("deterministic-ctx"):
        raise TypeError(
            f"fn must not be decorated with @reproducible / @isolated / @deterministic: "
            f"{_name(fn)} runs eagerly in its own block even when compiled (blocks are opaque "
            "to torch.compile), so eager would be compared with eager; pass the undecorated "
            "function (the check runs each side in a block itself)"
        )
    original = getattr(fn, "_torchdynamo_orig_callable", None)
    # torch.compiler.disable() sets the same attribute on functions it keeps eager.
    if original is not None and not getattr(fn, "_torchdynamo_disable", False):
        original = getattr(fn, "_orig_mod", original)  # an OptimizedModule's module
        raise TypeError(
            f"fn must be the eager function or module, got {_name(fn)} compiled with "
            f"torch.compile; pass the original ({_name(original)}) and the compile settings "
            "as backend=, mode=, options=, fullgraph=, dynamic=: the check compiles it itself"
        )


def _check_compile_args(
    backend: object, mode: object, options: object, fullgraph: object, dynamic: object
) -> None:
    if not (isinstance(backend, str) or callable(backend)):
        raise TypeError(
            "backend must be a torch.compile backend name (e.g. 'inductor') or a callable, "
            f"got {type(backend).__qualname__} {short_repr(backend)}"
        )
    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"mode must be None or a str, got {type(mode).__qualname__} {mode!r:.80}")
    if options is not None and not (
        isinstance(options, Mapping) and all(isinstance(k, str) for k in options)
    ):
        raise TypeError(
            "options must be None or a mapping of str keys, got "
            f"{type(options).__qualname__} {short_repr(options)}"
        )
    if type(fullgraph) is not bool:
        raise TypeError(f"fullgraph must be True or False, got {type(fullgraph).__name__}")
    if dynamic is not None and type(dynamic) is not bool:
        raise TypeError(f"dynamic must be None, True or False, got {type(dynamic).__name__}")


#: Options that ``torch.compile`` takes for itself, not for inductor's config.
_COMPILE_OPTIONS = ("guard_filter_fn", "use_aoti")


def _inductor_options(
    mode: str | None, options: Mapping[str, Any] | None, dynamic: bool | None, fallback: bool
) -> dict[str, Any]:
    """Inductor's options for the check: ``mode``'s, then ``options``, then ``fallback_random``.

    Why ``fallback_random`` is an option rather than only the block's config:
    dynamo caches compiled code per code object, for every ``torch.compile``
    of it, and does not guard on inductor's config, so a fresh
    ``torch.compile(fn)`` would reuse code the caller compiled earlier with
    another ``fallback_random`` (a function compiled under ``deterministic(0)``
    has the very guards of the check's block).  But a cache entry is reused
    only by an *equal* backend, and inductor's backend is equal when its
    options are.  With the option, the check never reuses code compiled with
    the other setting, and the caller's own ``torch.compile(fn)`` never reuses
    the check's.  The alternatives fall short: ``torch._dynamo.reset()`` drops
    every compiled function of the program; ``torch._dynamo.reset_code`` or a
    copy of ``fn.__code__`` reach only fn's own frame, not the frames after a
    graph break, nor a module (whose compiled frame is ``Module._call_impl``,
    shared by all modules), and the first drops the caller's compiled code.
    Equal options reuse the check's own earlier entries: a second check of
    ``fn`` compiles nothing, and checks add at most two entries per frame
    towards dynamo's recompile limit.
    """
    import torch._inductor.config as inductor_config

    merged: dict[str, Any] = {}
    if mode is not None and mode != "default":
        try:
            merged.update(torch._inductor.list_mode_options(mode, dynamic))
        except RuntimeError as exc:  # torch's message lists the modes
            raise ValueError(f"mode is not one of inductor's modes: {exc}") from None
    known = inductor_config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name in _COMPILE_OPTIONS:
            merged[key] = value
            continue
        if name == "fallback_random":
            raise ValueError(
                "options must not set fallback_random: pass compiled_rng='eager' (random ops "
                "fall back to eager's kernels) or compiled_rng=None (inductor's own setting)"
            )
        if name not in known:
            raise ValueError(f"options has {key!r}, which is not an option of inductor's config")
        merged[name] = value
    merged["fallback_random"] = fallback
    return merged


def _mismatch_hint(backend: str | Callable[..., Any], eager_rng: bool) -> str:
    arithmetic = (
        "inductor fuses and reorders floating-point operations (reductions; products "
        "that eager rounds inside a fused multiply-add, as in add(alpha=) of optimizer "
        "steps, and inductor rounds apart), which changes the last bits.  For float16 or "
        "bfloat16, try options={'emulate_precision_casts': True}; otherwise inductor "
        "does not promise bitwise equality: compare with a tolerance "
        "(torch.testing.assert_close)."
    )
    if backend != "inductor":
        return (
            f"The backend {short_repr(backend)} computed differently from eager (if it "
            "compiles with inductor, the notes on compiled_rng and arithmetic apply)."
        )
    if not eager_rng:
        return (
            "Inductor draws its own random numbers (torch._inductor.config.fallback_random "
            "is off): pass compiled_rng='eager' to make compiled random ops use eager's "
            "kernels.  If fn draws no random numbers: " + arithmetic
        )
    reorder = ""
    if tuple(int(part) for part in torch.__version__.split(".")[:2] if part.isdigit()) < (2, 13):
        # Seen on torch 2.11 (not on 2.13): dropout then torch.rand in one graph drew
        # eager's numbers in the other order.
        reorder = (
            "on this torch, inductor may run the random ops of one graph in another order "
            "than eager (seen on torch 2.11 with two random ops; not on 2.13); "
        )
    return (
        "Random ops ran eager's kernels (fallback_random), so the likely causes are: "
        + reorder
        + "np.random calls in fn (compiled, they draw from torch's generator unless "
        "torch._dynamo.config.use_numpy_random_stream is on); a model or optimizer fn reaches "
        "through a closure and that was not reset between the runs (pass it in reset=); "
        "or arithmetic: " + arithmetic
    )


def assert_compiled_matches_eager(
    fn: Callable[..., Any],
    /,
    *args: Any,
    seed: int = 0,
    compiled_rng: CompiledRng = "eager",
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    warn_only: bool = False,
    reset: Iterable[Any] = (),
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` eagerly and compiled with ``torch.compile``; require
    bit-for-bit equal results.

    Both runs are a fresh ``deterministic(seed, compiled_rng=compiled_rng,
    warn_only=warn_only)`` block: the same RNG state and flags, and the
    caller's RNGs and inductor config untouched afterwards.  The compiled run
    calls ``torch.compile(fn, backend=backend, mode=mode, options=options,
    fullgraph=fullgraph, dynamic=dynamic)``, made for the check; ``fn`` may be
    a module (the module is compiled) and must not be compiled already.
    Results are compared like :func:`assert_reproducible`'s, and modules and
    optimizers passed as ``fn``, as direct arguments or in ``reset`` are put
    back to their state before the compiled run and after it.

    ``compiled_rng="eager"`` (the default) makes inductor's random ops use
    eager's kernels (``fallback_random``), the only way compiled dropout masks
    and ``torch.rand`` equal eager's; ``None`` keeps inductor's setting (its own
    generator unless ``fallback_random`` is on), to check code as it runs in a
    block without the option.  Code the caller compiled earlier is never
    reused with the other setting, and the check's compiled code never serves
    the caller's ``torch.compile`` (inductor's ``fallback_random`` is one of
    the check's compile options; ``options`` must not set it).  For other
    backends ``compiled_rng`` only sets the block's config.

    Even with eager's random numbers, inductor rounds some arithmetic
    differently from eager (fused and reordered float operations): an SGD
    step on CPU, for one, often differs in the last bit (eager's kernel rounds
    ``p - lr * g`` once, in a fused multiply-add; inductor's code rounds the
    product first), and no setting of inductor's makes every result equal.

    Returns the eager run's result.  Raises :class:`CompiledMismatchError`
    naming the first differing path, with a hint at the likely cause; an
    exception from either run propagates as is (``fullgraph=True`` on code
    with a graph break raises torch's error).  The keyword-only arguments
    after ``fn`` are the check's; ``functools.partial`` passes ``fn``
    arguments of the same names.

    Example (compiling takes seconds, so not run as a doctest):
        >>> import torch
        >>> from deterministic_ctx import assert_compiled_matches_eager
        >>> def noisy(x):
        ...     return torch.nn.functional.dropout(x, 0.5) + torch.rand(3)
        >>> out = assert_compiled_matches_eager(noisy, torch.ones(3))  # doctest: +SKIP
        >>> try:                                                       # doctest: +SKIP
        ...     assert_compiled_matches_eager(noisy, torch.ones(3), compiled_rng=None)
        ... except AssertionError as err:
        ...     print(err.path)
        result
    """
    block = deterministic(seed, warn_only=warn_only, compiled_rng=compiled_rng)
    check_fn(fn)
    _check_not_compiled(fn)
    _check_compile_args(backend, mode, options, fullgraph, dynamic)
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        eager_rng = block.compiled_rng == "eager" or bool(inductor_config.fallback_random)
        options = _inductor_options(mode, options, dynamic, eager_rng)
        mode = None  # its options are in ``options``: torch takes one of the two
    else:
        if mode is not None and options is not None:
            raise ValueError("pass mode or options, not both (torch.compile takes one)")
        eager_rng = True  # only inductor draws random numbers of its own
    saved = SavedState(objects_to_reset(fn, args, kwargs, reset))
    # torch's config patches (torch.compile's own, for the options) put values
    # back but leave them marked as set by the user, which changes inductor's
    # compile-cache keys: every entry's override is put back afterwards.
    with unchanged_config("torch._inductor.config"):
        compiled: Callable[..., Any] = torch.compile(
            fn,
            backend=backend,
            mode=mode,
            options=None if options is None else dict(options),
            fullgraph=fullgraph,
            dynamic=dynamic,
        )
        try:
            with block:
                expected = call_and_consume(fn, args, kwargs)
            saved.load()
            with block:
                got = call_and_consume(compiled, args, kwargs)
        finally:
            saved.load()
    found = first_difference(expected, got)
    if found is not None:
        raise CompiledMismatchError(
            f"{_name(fn)} compiled (backend={short_repr(backend)}, "
            f"compiled_rng={block.compiled_rng!r}) differs from eager with "
            f"seed={block.seed} at {found.path}: {found.describe('eager', 'compiled')}\n"
            + _mismatch_hint(backend, eager_rng),
            path=found.path,
            index=found.index,
            max_abs_diff=found.max_abs_diff,
            seed=block.seed,
            compiled_rng=block.compiled_rng,
            backend=backend,
        )
    return expected


# --- batch invariance ----------------------------------------------------------------------------


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

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        index: tuple[int, ...] | None = None,
        max_abs_diff: float | None = None,
        seed: int | None = None,
        row: int | None = None,
        dim: int = 0,
        out_dim: int = 0,
    ) -> None:
        super().__init__(message, path=path, index=index, max_abs_diff=max_abs_diff, seed=seed)
        self.row = row
        self.dim = dim
        self.out_dim = out_dim


_STRUCTURES = "a tuple, list, dict, named tuple or dataclass"


def _check_dim(name: str, value: object) -> int:
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


def _batch_layout(batch: object, dim: int) -> tuple[list[torch.Tensor], list[int], int]:
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


def _result_layout(
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


def _check_rows(rows: object, size: int) -> list[int]:
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
        for field, value in zip(_compared_fields(obj), new, strict=True):
            object.__setattr__(instance, field.name, value)
        return instance
    except Exception as exc:
        raise TypeError(
            f"cannot rebuild a {type(obj).__qualname__} with one row of its tensors: {exc!r}; "
            f"batches and results must be tensors or {_STRUCTURES} of them"
        ) from exc


def _compared_fields(obj: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(obj) if f.compare]


def _with_tensors(obj: Any, new: Iterator[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by the next of ``new``.

    Walks exactly the tensors :func:`tensor_leaves` lists, in its order
    (containers as :func:`first_difference` recurses into them, not modules),
    so the n-th of ``new`` replaces the n-th leaf that it lists.
    """
    if isinstance(obj, torch.Tensor):
        return next(new)
    if isinstance(obj, torch.nn.Module):
        return obj
    if isinstance(obj, Mapping):
        old = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        old = list(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        old = [getattr(obj, f.name) for f in _compared_fields(obj)]
    else:
        return obj
    return _rebuilt(obj, old, [_with_tensors(member, new) for member in old])


def _row(obj: Any, tensors: list[torch.Tensor], dims: list[int], row: int, copied: bool) -> Any:
    """Row ``row`` of every tensor in ``obj`` (the batch dimension kept, of size 1);
    copies when ``copied``."""
    parts = [t.narrow(d, row, 1) for t, d in zip(tensors, dims, strict=True)]
    if copied:
        parts = [t.clone() for t in parts]
    found = iter(parts)
    rebuilt = _with_tensors(obj, found)
    assert next(found, None) is None, "a tensor of the structure was not replaced"
    return rebuilt


def _modules_hint(objects: list[Any]) -> str:
    """Submodules in training mode that make rows depend on each other or on the batch's shape."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.dropout import _DropoutNd

    notes = []
    for obj in objects:
        if not isinstance(obj, torch.nn.Module):
            continue
        for name, module in obj.named_modules():
            where = type(module).__qualname__ + (f" (submodule {name!r})" if name else "")
            if module.training and isinstance(module, _BatchNorm):
                notes.append(
                    f"{where} is in training mode: it normalizes with the batch's statistics"
                )
            elif module.training and isinstance(module, _DropoutNd) and module.p > 0:
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
        >>> from deterministic_ctx.verify import assert_batch_invariant
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
    check_fn(fn)
    dim = _check_dim("dim", dim)
    out_dim = dim if out_dim is None else _check_dim("out_dim", out_dim)
    tensors, dims, size = _batch_layout(batch, dim)
    checked = _check_rows(rows, size)
    objects = objects_to_reset(fn, args, kwargs, reset)
    name = _name(fn)
    # Copied before fn runs: a fn that changes its input in place cannot change
    # the rows through the batch (nor the batch through a row).
    alone_inputs = {i: _row(batch, tensors, dims, i, copied=True) for i in checked}
    saved = SavedState(objects)
    try:
        with block:
            batched = call_and_consume(fn, (batch, *args), kwargs)
        leaves, result_dims = _result_layout(batched, out_dim, size, name)
        leaf_dims = {path: d for (path, _), d in zip(leaves, result_dims, strict=True)}
        result_tensors = [t for _, t in leaves]
        # Copied now: a fn that writes into a reused output buffer would
        # otherwise overwrite the batched rows with the lone ones before the
        # comparison (the check would compare each lone result with itself).
        expected_rows = {
            i: _row(batched, result_tensors, result_dims, i, copied=True) for i in checked
        }
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
