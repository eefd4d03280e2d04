"""The two base classes of everything deterministic-ctx raises or warns,
:class:`StateWarning`, the warning every layer issues, and :class:`MisuseError`,
the error every layer raises for a tool used out of its order or place.

They live in this leaf module, below every layer (``.importlinter``), because
errors are defined in every layer, ``_torch`` included; users import them from
the package itself.  Every public error and warning sets ``__module__`` to
``"deterministic_ctx"``, so tracebacks, reprs and pickles name the path users
import (``deterministic_ctx.InvalidSnapshotError``), not the file it is
defined in.
"""

from __future__ import annotations

__all__ = [
    "PUBLIC_MODULE",
    "DeterministicCtxError",
    "DeterministicCtxWarning",
    "MisuseError",
    "StateWarning",
]

#: The ``__module__`` of every public error and warning: the path users import it from.
PUBLIC_MODULE = "deterministic_ctx"


class DeterministicCtxError(Exception):
    """The base class of every error deterministic-ctx raises.

    Each concrete error also keeps its built-in base (``ValueError``,
    ``RuntimeError``, ``AssertionError``, ...), so existing handlers still catch
    it; ``except DeterministicCtxError`` catches all of them, and only them.
    Misused arguments (a seed of the wrong type, an unknown option) raise plain
    ``TypeError`` / ``ValueError`` that name the argument.

    Example:
        >>> from deterministic_ctx import DeterministicCtxError, InvalidSnapshotError
        >>> issubclass(InvalidSnapshotError, DeterministicCtxError)
        True
        >>> issubclass(InvalidSnapshotError, ValueError)
        True
    """

    __module__ = PUBLIC_MODULE


class DeterministicCtxWarning(Warning):
    """The base class of every warning class deterministic-ctx defines.

    Each also keeps its built-in category (``RuntimeWarning``,
    ``UserWarning``), so one filter can silence or escalate them all:
    ``warnings.simplefilter("error", DeterministicCtxWarning)``, or
    ``-W error::deterministic_ctx.DeterministicCtxWarning`` on the command line.

    Example:
        >>> from deterministic_ctx import DeterministicCtxWarning, LockWaitWarning
        >>> issubclass(LockWaitWarning, DeterministicCtxWarning)
        True
        >>> issubclass(LockWaitWarning, RuntimeWarning)
        True
    """

    __module__ = PUBLIC_MODULE


class StateWarning(DeterministicCtxWarning, RuntimeWarning):
    """Random state or its inputs are not what they should be, and the library went on.

    Issued where raising would break a program that worked before: a forked
    child whose random state could not be put back, launcher variables that
    contradict the process group (``rank="auto"`` then follows the group),
    only one of ``RANK`` and ``WORLD_SIZE`` set, a snapshot loaded on a
    machine with other devices, ``random.random`` rebound to a generator
    blocks do not manage, or an RNG entry point that failed to load.  The
    message says what was done instead.

    Example:
        >>> issubclass(StateWarning, RuntimeWarning)
        True
    """

    __module__ = PUBLIC_MODULE


class MisuseError(DeterministicCtxError, RuntimeError):
    """A tool of the library was used where or when it cannot work.

    Raised for the library's own conditions, never for a bad argument: a
    block left in a thread (or task) that did not enter it, a
    :meth:`deterministic.stop() <deterministic_ctx.deterministic.stop>`
    without its ``start()`` in the same thread, a fork of
    :class:`~deterministic_ctx.RngStreams` left without being entered or out of
    order, an ``OpRecorder`` entered twice or read before it exits,
    :func:`~deterministic_ctx.seed_worker` called outside a DataLoader worker,
    :func:`~deterministic_ctx.broadcast_seed` called before the process group
    exists (or receiving something other than rank 0's seed), an op exempted by
    :class:`~deterministic_ctx.allow_nondeterministic` in a graph that
    ``torch.compile`` traces, :class:`~deterministic_ctx.LightningCallback` with
    a Lightning whose fit loop no longer has the train data source it wraps.  The message
    says what to do instead.  Also a ``RuntimeError``, which these were before.

    Example:
        >>> from deterministic_ctx import MisuseError, deterministic
        >>> try:
        ...     deterministic(seed=0).__exit__(None, None, None)
        ... except MisuseError as error:
        ...     print(error)
        deterministic block exited without being entered
        >>> issubclass(MisuseError, RuntimeError)
        True
    """

    __module__ = PUBLIC_MODULE
