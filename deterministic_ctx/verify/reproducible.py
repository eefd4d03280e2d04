"""``assert_reproducible``: run a function several times under one seed and compare bit for
bit; :class:`NotReproducibleError`, the error of every check of this package."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .._errors import PUBLIC_MODULE, DeterministicCtxError
from ..core.context import deterministic
from ..internal import exempted_calls
from .compare import first_difference
from .rerun import call_and_consume, check_runs, exempted_since, prepare_runs, suspects

__all__ = ["NotReproducibleError", "assert_reproducible", "fn_name"]


class NotReproducibleError(DeterministicCtxError, AssertionError):
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

    __module__ = PUBLIC_MODULE

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


def fn_name(fn: object) -> str:
    """``fn``'s name for messages: its qualified name, or its class's."""
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
        >>> from deterministic_ctx import assert_reproducible
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
    _, saved = prepare_runs(fn, args, kwargs, reset)
    try:
        with block:
            first = call_and_consume(fn, args, kwargs)
        for run in range(2, runs + 1):
            saved.load()
            calls = exempted_calls()
            try:
                with block:
                    other = call_and_consume(fn, args, kwargs)
            except Exception as exc:
                raise NotReproducibleError(
                    f"{fn_name(fn)} is not reproducible with seed={block.seed}: run {run} of "
                    f"{runs} raised {exc!r} where run 1 returned",
                    run=run,
                    seed=block.seed,
                ) from exc
            found = first_difference(first, other)
            if found is not None:
                suspect = suspects(exempted_since(calls), run)
                raise NotReproducibleError(
                    f"{fn_name(fn)} is not reproducible with seed={block.seed}: run {run} of "
                    f"{runs} differs from run 1 at {found.path}: "
                    f"{found.describe('run 1', f'run {run}')}\n"
                    "Randomness the block does not manage (os.urandom, time, an unregistered "
                    "generator: see register_rng) or a nondeterministic operation changed it; "
                    "locate_divergence() finds the first module call where a model diverges."
                    + (f"\n{suspect}" if suspect else ""),
                    path=found.path,
                    index=found.index,
                    max_abs_diff=found.max_abs_diff,
                    run=run,
                    seed=block.seed,
                )
        return first
    finally:
        saved.load()
