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
shared with :func:`~deterministic_ctx.verify.locate.locate_divergence`.

One module per check: :mod:`.reproducible` (with :class:`NotReproducibleError`,
the base of the other checks' errors), :mod:`.compiled` and :mod:`.batch`, whose
batches and results :mod:`.rows` splits into rows.
"""

from __future__ import annotations

from .batch import BatchInvarianceError, assert_batch_invariant
from .compiled import CompiledMismatchError, assert_compiled_matches_eager
from .reproducible import NotReproducibleError, assert_reproducible

__all__ = [
    "BatchInvarianceError",
    "CompiledMismatchError",
    "NotReproducibleError",
    "assert_batch_invariant",
    "assert_compiled_matches_eager",
    "assert_reproducible",
]
