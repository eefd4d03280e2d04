"""Traces: a run's fingerprints and environment, recorded on one machine and compared on another.

:func:`locate_divergence <deterministic_ctx.verify.locate.locate_divergence>` compares
two runs in one process.  When the same seed gives other results on another
machine, GPU model or torch version, the two runs never meet: record a trace
on each machine with :func:`record_trace` (or ``deterministic-ctx trace record``
for an unmodified script), bring the files together, and
:func:`compare_traces` names the first module call that differs and the facts
of the two environments that differ, most likely culprits first.

A trace holds, in call order, the fingerprints of every module call's outputs
(and, with ``backward=True``, of the gradients), of the return value's leaves
and of the final parameters and buffers, as :func:`~deterministic_ctx.verify.record.record`
records them for ``locate_divergence``; with ``ops=True`` also every aten op
call of the run (:class:`~deterministic_ctx.verify.ops.OpRecorder`: the op, the
user's ``file:line``, the fingerprints of its outputs and of the inputs it got
from outside the recorded ops), so that a comparison names the first op whose
result differs, before the module output it feeds; and the environment that
decides results, read inside the block right after ``fn`` returned (so the flags and
thread count are those ``fn`` ran with): Python, torch, NumPy and CUDA/cuDNN
versions, the platform, CPU model, vector instruction set and BLAS, the
thread counts, CUDA device names, compute capabilities and SM counts, the
TF32 and matmul precision settings, the determinism flags and the managed
environment variables (most of them from :func:`~deterministic_ctx.reporting.report`).

CUDA is never initialized for a trace: device facts are recorded only when
``fn`` (or the script) initialized CUDA itself.  Where it did not, nothing it
computed ran on a GPU, so no device fact can explain its results.

A trace keeps a 16-byte BLAKE2b digest of each fingerprint rather than the
fingerprint itself: 16 bytes per tensor whatever its size.  Two tensors of one
shape and dtype have equal digests exactly when their fingerprints are equal
(but for a 128-bit hash collision).  Neither tells *where* two tensors differ:
a trace has no values, so a divergence names the module call and the tensor,
never the index or the size of the difference.

**File**: the container of :mod:`~deterministic_ctx.state.checkpoint` (sizes checked
against the file's length, a SHA-256 checksum, JSON, nothing ever unpickled)
with the signature ``b"\\x89DCT\\r\\n\\x1a\\n"`` and this state, version 1::

    {"format": "deterministic_ctx.trace", "version": 1,
     "source": "function train_step", "recorded": "2025-01-31T12:00:00+00:00",
     "status": null,            # a script's exit status; null for a function
     "seed": 0, "backward": false,
     "ops": false,              # optional: whether per-op events were recorded
     "environment": {"versions.torch": "2.13.0+cpu", "process.num_threads": 8, ...},
     "modules": [[root class, qualified name, class name], ...],
     "calls": [[module, start], ...],   # per module call: its index in modules, and
                                        # how many events had been recorded when it started
     "events": [[key, phase, what, module or null, call or null,
                 [[path, dtype, digest or null, *shape], ...]], ...],
     "digests": uint8 tensor, 16 bytes per distinct fingerprint}

``phase`` is ``"forward"``, ``"backward"``, ``"result"`` (a leaf of the return
value), ``"final"`` or ``"op"`` (an aten op call, only when ``"ops"`` is true:
``what`` is the op and the user's line, ``"aten.addmm.default at train.py:42
(in step)"``, a path under the working directory relative to it; module and
call are those of the innermost module call it ran in, or null; the key is
``["op", k, n]``, the ``n``-th op call after ``k`` module calls had started;
the leaves are the inputs from outside the recorded ops, ``"input 'weight'"``,
then the outputs and the arguments changed in place).  A
newer version, an unknown field, a wrong type, an index out of range or a
file over the checkpoint size limit raises :class:`InvalidTraceError`, an
:class:`~deterministic_ctx.InvalidSnapshotError`.

One module per concern: :mod:`.recording` (:func:`record_trace`: a run and
what it computed), :mod:`.facts` (the environment that decides results),
:mod:`.fileformat` (:class:`Trace` and its file: writing, reading, checking),
:mod:`.culprits` (which facts differ, most likely culprits first) and
:mod:`.comparison` (:func:`compare_traces`); this package re-exports their
public names.

Example:
    >>> import torch
    >>> from deterministic_ctx import compare_traces, record_trace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> a = record_trace(model, torch.ones(2, 4))
    >>> b = record_trace(model, torch.ones(2, 4))
    >>> a.calls, compare_traces(a, b).agree
    (3, True)
"""

from __future__ import annotations

from .comparison import TraceComparison, compare_traces
from .culprits import EnvironmentDifference
from .facts import Fact as Fact
from .facts import environment
from .fileformat import FORMAT, TRACE_FILE, VERSION, InvalidTraceError, Trace
from .recording import record_in, record_trace, script_result

__all__ = [
    "FORMAT",
    "TRACE_FILE",
    "VERSION",
    "EnvironmentDifference",
    "InvalidTraceError",
    "Trace",
    "TraceComparison",
    "compare_traces",
    "environment",
    "record_in",
    "record_trace",
    "script_result",
]
