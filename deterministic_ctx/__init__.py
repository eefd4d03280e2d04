"""deterministic-ctx: reproducible, isolated randomness for PyTorch.

``with deterministic(seed=0):`` seeds every RNG and turns on deterministic
algorithms for a block, then restores everything bit for bit on exit.

``import deterministic_ctx`` imports neither torch nor NumPy: each public
name is loaded when it is first used (PEP 562), the engine with the first of
them, an integration (verification, reports, checkpoints) only with its own
names.  So ``deterministic-ctx run`` restarts the interpreter before torch is
loaded, and a test suite that never uses a report never imports it.

Example:
    >>> import random
    >>> from deterministic_ctx import deterministic
    >>> before = random.getstate()
    >>> with deterministic(seed=0):
    ...     _ = random.random()
    >>> random.getstate() == before
    True
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and readers
    from ._errors import (
        AbandonedBlockWarning,
        GraphCaptureError,
        InvalidSnapshotError,
        LockWaitWarning,
        RestoreError,
    )
    from ._lock import set_lock_warning
    from ._seed import derive_seed
    from .audit import AuditFinding, AuditReport, audit_nondeterminism
    from .context import deterministic, isolated
    from .data import chain_worker_init, seed_worker, seeded_generator
    from .dcp import RngState
    from .decorate import reproducible
    from .distributed import Ranks, broadcast_seed, rank_seed, ranks
    from .locate import DivergenceReport, locate_divergence
    from .reporting import DeterminismReport, report
    from .reporting import report as determinism_report
    from .seeding import seed_everything
    from .snapshot import Snapshot
    from .sources import register_rng, registered_rngs, unregister_rng
    from .sources.environ import DETERMINISTIC_COLLECTIVES, managed_env_vars, register_env_var
    from .streams import RngStreams
    from .sync import RngStateError, sync_rng_state
    from .trace import InvalidTraceError, Trace, TraceComparison, compare_traces, record_trace
    from .verify import (
        BatchInvarianceError,
        CompiledMismatchError,
        NotReproducibleError,
        assert_batch_invariant,
        assert_compiled_matches_eager,
        assert_reproducible,
    )

__all__ = [
    "DETERMINISTIC_COLLECTIVES",
    "AbandonedBlockWarning",
    "AuditFinding",
    "AuditReport",
    "BatchInvarianceError",
    "CompiledMismatchError",
    "DeterminismReport",
    "DivergenceReport",
    "GraphCaptureError",
    "InvalidSnapshotError",
    "InvalidTraceError",
    "LockWaitWarning",
    "NotReproducibleError",
    "Ranks",
    "RestoreError",
    "RngState",
    "RngStateError",
    "RngStreams",
    "Snapshot",
    "Trace",
    "TraceComparison",
    "assert_batch_invariant",
    "assert_compiled_matches_eager",
    "assert_reproducible",
    "audit_nondeterminism",
    "broadcast_seed",
    "chain_worker_init",
    "compare_traces",
    "derive_seed",
    "determinism_report",
    "deterministic",
    "isolated",
    "locate_divergence",
    "managed_env_vars",
    "rank_seed",
    "ranks",
    "record_trace",
    "register_env_var",
    "register_rng",
    "registered_rngs",
    "report",
    "reproducible",
    "seed_everything",
    "seed_worker",
    "seeded_generator",
    "set_lock_warning",
    "sync_rng_state",
    "unregister_rng",
]

#: Where each public name lives: ``(module, attribute)``.
_WHERE: dict[str, tuple[str, str]] = {
    "AbandonedBlockWarning": ("._errors", "AbandonedBlockWarning"),
    "AuditFinding": (".audit", "AuditFinding"),
    "AuditReport": (".audit", "AuditReport"),
    "BatchInvarianceError": (".verify", "BatchInvarianceError"),
    "CompiledMismatchError": (".verify", "CompiledMismatchError"),
    "DETERMINISTIC_COLLECTIVES": (".sources.environ", "DETERMINISTIC_COLLECTIVES"),
    "DeterminismReport": (".reporting", "DeterminismReport"),
    "DivergenceReport": (".locate", "DivergenceReport"),
    "GraphCaptureError": ("._errors", "GraphCaptureError"),
    "InvalidSnapshotError": ("._errors", "InvalidSnapshotError"),
    "InvalidTraceError": (".trace", "InvalidTraceError"),
    "LockWaitWarning": ("._errors", "LockWaitWarning"),
    "NotReproducibleError": (".verify", "NotReproducibleError"),
    "Ranks": (".distributed", "Ranks"),
    "RestoreError": ("._errors", "RestoreError"),
    "RngState": (".dcp", "RngState"),
    "RngStateError": (".sync", "RngStateError"),
    "RngStreams": (".streams", "RngStreams"),
    "Snapshot": (".snapshot", "Snapshot"),
    "Trace": (".trace", "Trace"),
    "TraceComparison": (".trace", "TraceComparison"),
    "assert_batch_invariant": (".verify", "assert_batch_invariant"),
    "assert_compiled_matches_eager": (".verify", "assert_compiled_matches_eager"),
    "assert_reproducible": (".verify", "assert_reproducible"),
    "audit_nondeterminism": (".audit", "audit_nondeterminism"),
    "broadcast_seed": (".distributed", "broadcast_seed"),
    "chain_worker_init": (".data", "chain_worker_init"),
    "compare_traces": (".trace", "compare_traces"),
    "derive_seed": ("._seed", "derive_seed"),
    "determinism_report": (".reporting", "report"),
    "deterministic": (".context", "deterministic"),
    "isolated": (".context", "isolated"),
    "locate_divergence": (".locate", "locate_divergence"),
    "managed_env_vars": (".sources.environ", "managed_env_vars"),
    "rank_seed": (".distributed", "rank_seed"),
    "ranks": (".distributed", "ranks"),
    "record_trace": (".trace", "record_trace"),
    "register_env_var": (".sources.environ", "register_env_var"),
    "register_rng": (".sources", "register_rng"),
    "registered_rngs": (".sources", "registered_rngs"),
    "report": (".reporting", "report"),
    "reproducible": (".decorate", "reproducible"),
    "seed_everything": (".seeding", "seed_everything"),
    "seed_worker": (".data", "seed_worker"),
    "seeded_generator": (".data", "seeded_generator"),
    "set_lock_warning": ("._lock", "set_lock_warning"),
    "sync_rng_state": (".sync", "sync_rng_state"),
    "unregister_rng": (".sources", "unregister_rng"),
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = where
    try:
        value = getattr(importlib.import_module(module, __name__), attribute)
    except AttributeError as exc:
        # ``from deterministic_ctx import name`` turns an AttributeError raised
        # here into "cannot import name", and drops it: the real cause (a torch
        # attribute missing while a module loads, say) would be lost.
        raise _LoadError(name, module, exc) from exc
    globals()[name] = value  # later lookups are plain attribute reads
    return value


class _LoadError(ImportError):
    """A public name whose module failed to load with an ``AttributeError``:
    raised as an ``ImportError`` that names the real cause, which is chained."""

    def __init__(self, name: str, module: str, cause: AttributeError) -> None:
        super().__init__(
            f"deterministic_ctx.{name} could not be loaded: importing or reading "
            f"deterministic_ctx{module} raised {type(cause).__name__}: {cause}",
            name=__name__,
        )


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext deterministic_ctx``: registers ``%%deterministic`` and
    ``%deterministic_report`` (see :mod:`deterministic_ctx.ipython`).

    IPython is imported only here, never at package import.
    """
    from .ipython import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext deterministic_ctx``."""
    from .ipython import unload_ipython_extension as unload

    unload(ipython)
