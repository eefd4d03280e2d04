"""``audit_nondeterminism``: the ops of a run that are nondeterministic on CUDA, found on a CPU.

Which ops of a model are nondeterministic on a GPU?  Today one learns it from
a ``RuntimeError`` under ``torch.use_deterministic_algorithms(True)`` on the
GPU, one op at a time, or from a list in torch's docs.  The audit runs the
function once, wherever its tensors are (a CPU is enough), under a
``TorchDispatchMode`` that sees every aten op call, and matches each call
against a table of the cases (:mod:`.table`, checked against
torch 2.11 on a GPU and 2.13 from source; where torch changed a behaviour, the
running release's is used): the op, the condition on its arguments
(``index_put_(accumulate=False)``, ``scatter_reduce(reduce="prod")``,
``EmbeddingBag(mode="max")`` backward, ...) and what deterministic mode does
on CUDA: raise, warn, switch to a deterministic kernel, or nothing.  Each finding names
the module that made the call and the user's ``file:line`` (frames of torch,
of this package and of the standard library are skipped); an op of autograd's
backward pass is attributed to the forward call that created it.

Why the CPU and not the meta device: ``fn`` builds or holds its own tensors,
which the audit cannot move; data-dependent ops (``nonzero``, ``.item()``,
Python control flow on values) do not run on meta tensors; and for most ops
the CPU runs the same aten ops at the level the audit watches.  Where the CPU
runs another kernel than CUDA would (attention with dropout), the table says
so.  Recurrent layers are the exception the table cannot cover: on CUDA,
``nn.RNN``/``nn.LSTM``/``nn.GRU`` run cuDNN's RNN ops, on the CPU other ones
(``mkldnn_rnn_layer``), so the audit never sees the CUDA ops; the report adds
a note when such a module ran (torch documents them as deterministic on CUDA
only with ``CUBLAS_WORKSPACE_CONFIG`` set).

One module per part: :mod:`.table` reads the table (a data file, with the types
of :mod:`.model` and the predicates of :mod:`.conditions`), :mod:`.recorder` is
the dispatch mode that matches calls against the table and names where each
came from, :mod:`.findings` holds what it found, and :mod:`.run` runs ``fn``
and makes the report.

Example:
    >>> import torch
    >>> from deterministic_ctx import audit_nondeterminism
    >>> up = torch.nn.Upsample(scale_factor=2, mode="bicubic")
    >>> report = audit_nondeterminism(up, torch.randn(1, 1, 4, 4, requires_grad=True))
    >>> [(f.op, f.phase, f.behaviour) for f in report.findings]
    [('aten.upsample_bicubic2d_backward.default', 'backward', 'raise')]
"""

from __future__ import annotations

from .findings import AuditFinding, AuditReport
from .model import UncheckedTorchWarning
from .run import audit_nondeterminism

__all__ = ["AuditFinding", "AuditReport", "UncheckedTorchWarning", "audit_nondeterminism"]
