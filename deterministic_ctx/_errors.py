"""Exceptions and warnings raised by deterministic-ctx."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["LockWaitWarning", "RestoreError"]


class RestoreError(RuntimeError):
    """One or more sources of random state could not be put back.

    Every other source *was* restored before this is raised: a failure in one
    place never leaves the rest of the process half-restored.  ``failures``
    maps the name of each source that failed to the exception it raised.

    Example:
        >>> err = RestoreError({"numpy": ValueError("bad state")})
        >>> sorted(err.failures)
        ['numpy']
    """

    def __init__(self, failures: Mapping[str, BaseException]) -> None:
        self.failures: dict[str, BaseException] = dict(failures)
        detail = "; ".join(f"{name}: {exc!r}" for name, exc in self.failures.items())
        super().__init__(
            f"could not restore {len(self.failures)} source(s) of random state "
            f"(all others were restored): {detail}"
        )


class LockWaitWarning(RuntimeWarning):
    """A thread has waited a long time to enter a deterministic block.

    RNG state is process-global, so blocks in different threads run one after
    another.  When a thread waits longer than the configured time (see
    :func:`deterministic_ctx.set_lock_warning`), this warning names the thread
    that holds the block, then the thread keeps waiting.

    Example:
        >>> issubclass(LockWaitWarning, RuntimeWarning)
        True
    """
