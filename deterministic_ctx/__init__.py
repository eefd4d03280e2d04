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

from ._errors import DeterministicCtxError as DeterministicCtxError
from ._errors import DeterministicCtxWarning as DeterministicCtxWarning
from ._errors import MisuseError as MisuseError
from ._errors import StateWarning as StateWarning
from .base.version import __version__ as __version__

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and readers
    from ._torch import TorchFeatureError
    from .audit import AuditFinding, AuditReport, UncheckedTorchWarning, audit_nondeterminism
    from .base.errors import (
        AbandonedBlockWarning,
        DeviceMismatchError,
        GraphCaptureError,
        InvalidSnapshotError,
        LockWaitWarning,
        RestoreError,
        UnregisteredRngError,
    )
    from .base.lock import set_lock_warning
    from .base.seed import derive_seed
    from .core.context import deterministic, isolated
    from .core.decorate import reproducible
    from .core.exempt import allow_nondeterministic
    from .integrations.check_resume import checkpoint_saved, record_step
    from .integrations.lightning import LightningCallback
    from .integrations.transformers import TransformersCallback
    from .parallel.data import chain_worker_init, seed_worker, seeded_generator
    from .parallel.keyed import SeededDataset, SeededIndex, SeededSampler
    from .parallel.ranks import Ranks, broadcast_seed, rank_seed, ranks
    from .parallel.seeding import seed_everything
    from .parallel.streams import RngStreams
    from .reporting import DeterminismReport, report
    from .reporting.collectives import DETERMINISTIC_COLLECTIVES
    from .sources import register_rng, registered_rngs, unregister_rng
    from .sources.environ import managed_env_vars, register_env_var
    from .state.dcp import RngState
    from .state.snapshot import Snapshot
    from .state.sync import RngStateError, sync_rng_state
    from .trace import InvalidTraceError, Trace, TraceComparison, compare_traces, record_trace
    from .verify import (
        BatchInvarianceError,
        CompiledMismatchError,
        NotReproducibleError,
        assert_batch_invariant,
        assert_compiled_matches_eager,
        assert_reproducible,
    )
    from .verify.locate import DivergenceReport, locate_divergence

__all__ = [
    "DETERMINISTIC_COLLECTIVES",
    "AbandonedBlockWarning",
    "AuditFinding",
    "AuditReport",
    "BatchInvarianceError",
    "CompiledMismatchError",
    "DeterminismReport",
    "DeterministicCtxError",
    "DeterministicCtxWarning",
    "DeviceMismatchError",
    "DivergenceReport",
    "GraphCaptureError",
    "InvalidSnapshotError",
    "InvalidTraceError",
    "LightningCallback",
    "LockWaitWarning",
    "MisuseError",
    "NotReproducibleError",
    "Ranks",
    "RestoreError",
    "RngState",
    "RngStateError",
    "RngStreams",
    "SeededDataset",
    "SeededIndex",
    "SeededSampler",
    "Snapshot",
    "StateWarning",
    "TorchFeatureError",
    "Trace",
    "TraceComparison",
    "TransformersCallback",
    "UncheckedTorchWarning",
    "UnregisteredRngError",
    "allow_nondeterministic",
    "assert_batch_invariant",
    "assert_compiled_matches_eager",
    "assert_reproducible",
    "audit_nondeterminism",
    "broadcast_seed",
    "chain_worker_init",
    "checkpoint_saved",
    "compare_traces",
    "derive_seed",
    "deterministic",
    "isolated",
    "locate_divergence",
    "managed_env_vars",
    "rank_seed",
    "ranks",
    "record_step",
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
    "allow_nondeterministic": (".core.exempt", "allow_nondeterministic"),
    "AbandonedBlockWarning": (".base.errors", "AbandonedBlockWarning"),
    "AuditFinding": (".audit", "AuditFinding"),
    "AuditReport": (".audit", "AuditReport"),
    "BatchInvarianceError": (".verify", "BatchInvarianceError"),
    "CompiledMismatchError": (".verify", "CompiledMismatchError"),
    "DETERMINISTIC_COLLECTIVES": (".reporting.collectives", "DETERMINISTIC_COLLECTIVES"),
    "DeterminismReport": (".reporting", "DeterminismReport"),
    "DeviceMismatchError": (".base.errors", "DeviceMismatchError"),
    "DivergenceReport": (".verify.locate", "DivergenceReport"),
    "GraphCaptureError": (".base.errors", "GraphCaptureError"),
    "InvalidSnapshotError": (".base.errors", "InvalidSnapshotError"),
    "InvalidTraceError": (".trace", "InvalidTraceError"),
    "LightningCallback": (".integrations.lightning", "LightningCallback"),
    "LockWaitWarning": (".base.errors", "LockWaitWarning"),
    "NotReproducibleError": (".verify", "NotReproducibleError"),
    "Ranks": (".parallel.ranks", "Ranks"),
    "RestoreError": (".base.errors", "RestoreError"),
    "RngState": (".state.dcp", "RngState"),
    "RngStateError": (".state.sync", "RngStateError"),
    "RngStreams": (".parallel.streams", "RngStreams"),
    "SeededDataset": (".parallel.keyed", "SeededDataset"),
    "SeededIndex": (".parallel.keyed", "SeededIndex"),
    "SeededSampler": (".parallel.keyed", "SeededSampler"),
    "Snapshot": (".state.snapshot", "Snapshot"),
    "Trace": (".trace", "Trace"),
    "TorchFeatureError": ("._torch", "TorchFeatureError"),
    "TraceComparison": (".trace", "TraceComparison"),
    "TransformersCallback": (".integrations.transformers", "TransformersCallback"),
    "UncheckedTorchWarning": (".audit", "UncheckedTorchWarning"),
    "UnregisteredRngError": (".base.errors", "UnregisteredRngError"),
    "assert_batch_invariant": (".verify", "assert_batch_invariant"),
    "assert_compiled_matches_eager": (".verify", "assert_compiled_matches_eager"),
    "assert_reproducible": (".verify", "assert_reproducible"),
    "audit_nondeterminism": (".audit", "audit_nondeterminism"),
    "broadcast_seed": (".parallel.ranks", "broadcast_seed"),
    "chain_worker_init": (".parallel.data", "chain_worker_init"),
    "checkpoint_saved": (".integrations.check_resume", "checkpoint_saved"),
    "compare_traces": (".trace", "compare_traces"),
    "derive_seed": (".base.seed", "derive_seed"),
    "deterministic": (".core.context", "deterministic"),
    "isolated": (".core.context", "isolated"),
    "locate_divergence": (".verify.locate", "locate_divergence"),
    "managed_env_vars": (".sources.environ", "managed_env_vars"),
    "rank_seed": (".parallel.ranks", "rank_seed"),
    "ranks": (".parallel.ranks", "ranks"),
    "record_step": (".integrations.check_resume", "record_step"),
    "record_trace": (".trace", "record_trace"),
    "register_env_var": (".sources.environ", "register_env_var"),
    "register_rng": (".sources", "register_rng"),
    "registered_rngs": (".sources", "registered_rngs"),
    "report": (".reporting", "report"),
    "reproducible": (".core.decorate", "reproducible"),
    "seed_everything": (".parallel.seeding", "seed_everything"),
    "seed_worker": (".parallel.data", "seed_worker"),
    "seeded_generator": (".parallel.data", "seeded_generator"),
    "set_lock_warning": (".base.lock", "set_lock_warning"),
    "sync_rng_state": (".state.sync", "sync_rng_state"),
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


class _LoadError(DeterministicCtxError, ImportError):
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
    ``%deterministic_report`` (see :mod:`deterministic_ctx.integrations.ipython`).

    IPython is imported only here, never at package import.
    """
    from .integrations.ipython import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext deterministic_ctx``."""
    from .integrations.ipython import unload_ipython_extension as unload

    unload(ipython)
