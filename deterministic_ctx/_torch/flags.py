"""torch's C functions (``torch._C``), bound once: the determinism and precision
flags, the default dtype and device, and the few other C-level reads.

Every name here *is* torch's C builtin, bound at import (no Python wrapper,
no frame of its own): the hot paths of a block call them directly, as
``from .._torch.flags import get_deterministic_algorithms`` does.  This
module and :mod:`deterministic_ctx._torch.internals` are the only places
that name torch's private attributes (with the capabilities in
:mod:`deterministic_ctx._torch`, for the C API that not every torch has).

Each name says what it reads, the torch versions that have it (the
supported range, torch 2.1 and later, unless said), and what happens
without it.  Names that every supported torch has are bound directly: a
torch without them fails at import, as the public setters
(``torch.use_deterministic_algorithms``, ...) that call them would.

Importing this module imports torch.

Example:
    >>> from deterministic_ctx._torch import flags
    >>> isinstance(flags.get_deterministic_algorithms(), bool)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "HAS_CUDA",
    "HAS_MPS",
    "current_autograd_node",
    "get_cudnn_allow_tf32",
    "get_cudnn_benchmark",
    "get_cudnn_deterministic",
    "get_default_device",
    "get_deterministic_algorithms",
    "get_deterministic_algorithms_warn_only",
    "get_float32_matmul_precision",
    "set_cudnn_allow_tf32",
    "set_cudnn_benchmark",
    "set_cudnn_deterministic",
    "set_default_dtype",
    "set_default_tensor_type",
    "set_deterministic_algorithms",
    "set_eval_frame",
    "set_float32_matmul_precision",
]

_C: Any = torch._C


# -- determinism flags (sources/flags.py) ----------------------------------------------

get_deterministic_algorithms: Callable[[], bool] = _C._get_deterministic_algorithms
"""``torch._C._get_deterministic_algorithms``: ``torch.are_deterministic_algorithms_enabled()``
without the Python frame (every supported torch)."""

get_deterministic_algorithms_warn_only: Callable[[], bool] = (
    _C._get_deterministic_algorithms_warn_only
)
"""``torch._C._get_deterministic_algorithms_warn_only``:
``torch.is_deterministic_algorithms_warn_only_enabled()`` (every supported torch)."""

set_deterministic_algorithms: Callable[..., None] = _C._set_deterministic_algorithms
"""``torch._C._set_deterministic_algorithms(mode, warn_only=False)``: writes the mode and
``warn_only`` together (every supported torch)."""

get_cudnn_deterministic: Callable[[], bool] = _C._get_cudnn_deterministic
"""``torch._C._get_cudnn_deterministic``: ``torch.backends.cudnn.deterministic``, also on a
CPU build (every supported torch)."""

set_cudnn_deterministic: Callable[[bool], None] = _C._set_cudnn_deterministic
"""``torch._C._set_cudnn_deterministic`` (every supported torch)."""

get_cudnn_benchmark: Callable[[], bool] = _C._get_cudnn_benchmark
"""``torch._C._get_cudnn_benchmark``: ``torch.backends.cudnn.benchmark`` (every supported
torch)."""

set_cudnn_benchmark: Callable[[bool], None] = _C._set_cudnn_benchmark
"""``torch._C._set_cudnn_benchmark`` (every supported torch)."""


# -- precision flags (sources/flags.py) ---------------------------------------------------

get_float32_matmul_precision: Callable[[], str] = _C._get_float32_matmul_precision
"""``torch._C._get_float32_matmul_precision``: ``torch.get_float32_matmul_precision()``
(every supported torch).  From torch 2.9 it raises ``RuntimeError`` where the
``fp32_precision`` entries disagree with the legacy value; the caller works the
value out then."""

set_float32_matmul_precision: Callable[[str], None] = _C._set_float32_matmul_precision
"""``torch._C._set_float32_matmul_precision`` (every supported torch)."""

get_cudnn_allow_tf32: Callable[[], bool] = _C._get_cudnn_allow_tf32
"""``torch._C._get_cudnn_allow_tf32``: ``torch.backends.cudnn.allow_tf32`` (every supported
torch; raises ``RuntimeError`` from torch 2.9 where the ``fp32_precision`` entries of conv
and rnn disagree with it)."""

set_cudnn_allow_tf32: Callable[[bool], None] = _C._set_cudnn_allow_tf32
"""``torch._C._set_cudnn_allow_tf32`` (every supported torch)."""

# -- torch's process defaults (sources/torch_defaults.py) ---------------------------------

set_default_dtype: Callable[[Any], None] = _C._set_default_dtype
"""``torch._C._set_default_dtype``: ``torch.set_default_dtype`` without its Python checks
(every supported torch)."""

set_default_tensor_type: Callable[[Any], None] = _C._set_default_tensor_type
"""``torch._C._set_default_tensor_type`` (every supported torch)."""

get_default_device: Callable[[], str] = _C._get_default_device
"""``torch._C._get_default_device``: the device of the default tensor type, as a string
(every supported torch)."""

HAS_CUDA: bool = bool(getattr(_C, "_has_cuda", True))
"""``torch._C._has_cuda``: whether this build has CUDA (every supported torch); where it is
missing, assumed ``True`` (the cautious answer)."""

HAS_MPS: bool = bool(getattr(_C, "_has_mps", False))
"""``torch._C._has_mps``: whether this build has Apple's MPS (every supported torch); where it
is missing, ``False``: MPS generators are not captured."""


# -- autograd and dynamo (audit, verify.ops, _torch/compiler.py) -------------------------

current_autograd_node: Callable[[], Any] = _C._current_autograd_node
"""``torch._C._current_autograd_node``: the autograd node whose backward runs now on this
thread, ``None`` outside a backward pass (every supported torch)."""

set_eval_frame: Callable[[Any], Any] | None = getattr(
    getattr(getattr(_C, "_dynamo", None), "eval_frame", None), "set_eval_frame", None
)
"""``torch._C._dynamo.eval_frame.set_eval_frame``: dynamo's C frame hook (every supported
torch; ``None`` on a build without dynamo, where nothing compiles and a block has no
compiler to suspend)."""
