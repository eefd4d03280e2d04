"""``assert_compiled_matches_eager``: a function eagerly and compiled with ``torch.compile``,
under one seed, bit for bit; :class:`CompiledMismatchError` when they differ."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._errors import PUBLIC_MODULE
from .._torch import release_of
from .._torch.internals import (
    DYNAMO_CONFIG,
    INDUCTOR_CONFIG,
    compiled_in_place,
    compiled_original,
    dynamo_disable_message,
    inductor_config,
    inductor_mode_options,
)
from ..core.context import deterministic
from ..internal import CompiledRng, check_bool, unchanged_config
from .compare import first_difference, short_repr
from .reproducible import NotReproducibleError, fn_name
from .rerun import call_and_consume, prepare_runs

__all__ = ["CompiledMismatchError", "assert_compiled_matches_eager"]


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

    __module__ = PUBLIC_MODULE

    def __init__(
        self,
        message: str,
        *,
        compiled_rng: CompiledRng = "eager",
        backend: str | Callable[..., Any] = "inductor",
        **where: Any,
    ) -> None:
        super().__init__(message, **where)  # path, index, max_abs_diff, seed
        self.compiled_rng = compiled_rng
        self.backend = backend


def _check_not_compiled(fn: object) -> None:
    """``fn`` is the eager function: a compiled one would make the eager run compiled too."""
    if isinstance(fn, torch.nn.Module) and compiled_in_place(fn):
        raise TypeError(
            f"fn must be an eager module, got {type(fn).__qualname__} compiled in place with "
            "Module.compile(); pass a module that is not compiled: the check compiles it itself"
        )
    if dynamo_disable_message(fn).startswith("deterministic-ctx"):
        raise TypeError(
            f"fn must not be decorated with @reproducible / @isolated / @deterministic: "
            f"{fn_name(fn)} runs eagerly in its own block even when compiled (blocks are opaque "
            "to torch.compile), so eager would be compared with eager; pass the undecorated "
            "function (the check runs each side in a block itself)"
        )
    original = compiled_original(fn)
    if original is not None:
        raise TypeError(
            f"fn must be the eager function or module, got {fn_name(fn)} compiled with "
            f"torch.compile; pass the original ({fn_name(original)}) and the compile settings "
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
    check_bool(fullgraph, "fullgraph")
    if dynamic is not None and type(dynamic) is not bool:
        raise TypeError(f"dynamic must be None, True or False, got {dynamic!r:.80}")


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
    merged: dict[str, Any] = {}
    if mode is not None and mode != "default":
        try:
            merged.update(inductor_mode_options(mode, dynamic))
        except RuntimeError as exc:  # the message lists the modes (on every torch)
            raise ValueError(f"mode is not one of inductor's modes: {exc}") from None
    known = inductor_config().get_config_copy()
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
            f"Inductor draws its own random numbers ({INDUCTOR_CONFIG}.fallback_random "
            "is off): pass compiled_rng='eager' to make compiled random ops use eager's "
            "kernels.  If fn draws no random numbers: " + arithmetic
        )
    reorder = ""
    if release_of(torch.__version__) < (2, 13):
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
        f"{DYNAMO_CONFIG}.use_numpy_random_stream is on); a model or optimizer fn reaches "
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
    _, saved = prepare_runs(fn, args, kwargs, reset)
    _check_not_compiled(fn)
    _check_compile_args(backend, mode, options, fullgraph, dynamic)
    if backend == "inductor":
        eager_rng = block.compiled_rng == "eager" or bool(inductor_config().fallback_random)
        options = _inductor_options(mode, options, dynamic, eager_rng)
        mode = None  # its options are in ``options``: torch takes one of the two
    else:
        if mode is not None and options is not None:
            raise ValueError("pass mode or options, not both (torch.compile takes one)")
        eager_rng = True  # only inductor draws random numbers of its own
    # torch's config patches (torch.compile's own, for the options) put values
    # back but leave them marked as set by the user, which changes inductor's
    # compile-cache keys: every entry's override is put back afterwards.
    with unchanged_config(INDUCTOR_CONFIG):
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
            f"{fn_name(fn)} compiled (backend={short_repr(backend)}, "
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
