"""An independent view of global random state, built only from public APIs.

Tests compare against this rather than against ``Snapshot``, so a bug in the
library's own capture cannot hide a bug in its restore.  Which of torch's
attributes exist is asked of the library's capability probes
(``deterministic_ctx._torch``), so the guard reads what every supported torch
has; the values themselves are read here, through torch's public API.
"""

from __future__ import annotations

import importlib
import os
import random
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deterministic_ctx import _torch
from tests.helpers import default_device

#: Every environment variable a block must put back (docs/explanation/captures.md), written
#: out here rather than read from the library, so the guard stays independent.
ENV_NAMES = (
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTHONHASHSEED",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "FLASH_ATTENTION_DETERMINISTIC",
    "HCCL_DETERMINISTIC",
    "CUDA_LAUNCH_BLOCKING",
    "ASCEND_LAUNCH_BLOCKING",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
    "TF_DETERMINISTIC_OPS",
    "TF_CUDNN_DETERMINISTIC",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_BUFFSIZE",
    "NCCL_TOPO_FILE",
    "NCCL_TUNER_PLUGIN",
    "TORCHINDUCTOR_DETERMINISTIC",
    "MKL_CBWR",
    "DETERMINISTIC_CTX_SEED",
)


def _np_state() -> tuple[Any, ...]:
    rs = np.random.mtrand._rand
    st = rs.get_state(legacy=False)
    inner = st["state"]
    flat = tuple(
        (k, v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in sorted(inner.items())
    )
    return (id(rs._bit_generator), st["bit_generator"], flat, st["has_gauss"], st["gauss"])


def _lazy(module: Any) -> tuple[Any, ...]:
    t = module._lazy_seed_tracker
    return (
        _queued(t.manual_seed_all_cb),
        _queued(t.manual_seed_cb),
        tuple(map(_queued, t.call_order)),
        len(module._queued_calls),
    )


def _queued(entry: Any) -> Any:
    """A queued ``(callback, traceback)`` compared by what it does: two seed callbacks
    queued by two calls are two closures, equal when they seed the same number."""
    if not isinstance(entry, tuple) or not entry:
        return entry
    fn = entry[0]
    closure = getattr(fn, "__closure__", None)
    if closure is None:
        return (fn, *entry[1:2])
    cells = tuple(c.cell_contents for c in closure if isinstance(c.cell_contents, (int, str)))
    return (getattr(fn, "__qualname__", fn), cells, tuple(entry[1]) if len(entry) > 1 else ())


def _flags() -> tuple[Any, ...]:
    """The flags through torch's public attributes; a flag this torch lacks (the
    library's capability probes say which) reads ``"absent"``."""
    import sys

    inductor = sys.modules.get("torch._inductor.config")
    # A module that not every torch imports by itself.
    fill = _torch.FILL_UNINITIALIZED_MEMORY.available and importlib.import_module(
        "torch.utils.deterministic"
    )
    return (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        fill.fill_uninitialized_memory if fill else "absent",
        torch.backends.mkldnn.deterministic if _torch.MKLDNN_DETERMINISTIC.available else "absent",
        # An import cannot be undone: "not imported" counts as its default.
        # On a torch without the flag (< 2.7) it reads the same imported or not.
        (os.getenv("TORCHINDUCTOR_DETERMINISTIC") == "1")
        if inductor is None or not hasattr(inductor, "deterministic")
        else inductor.deterministic,
        # Default-ness too: inductor's compile-cache keys depend on it.
        _is_default(inductor, "deterministic"),
        _read(torch.get_float32_matmul_precision),
        _read(lambda: torch.backends.cuda.matmul.allow_tf32),
        _read(lambda: torch.backends.cudnn.allow_tf32),
        *(_precision() if _torch.FP32_PRECISION.available else ()),
    )


def _precision() -> tuple[Any, ...]:
    return (
        torch.backends.fp32_precision,
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.cudnn.fp32_precision,
        torch.backends.cudnn.conv.fp32_precision,
        torch.backends.cudnn.rnn.fp32_precision,
        torch.backends.mkldnn.fp32_precision,
        torch.backends.mkldnn.matmul.fp32_precision,
        torch.backends.mkldnn.conv.fp32_precision,
        torch.backends.mkldnn.rnn.fp32_precision,
    )


def _is_default(config: Any, key: str) -> Any:
    """Whether a config entry is at its default; ``True`` where the module is not
    imported; on a torch without ``_is_default`` (< 2.2), whether it equals its default."""
    if config is None or not hasattr(config, key):
        return True
    if not hasattr(config, "_is_default"):
        # torch 2.1's config modules: a table of defaults, and no user overrides.
        defaults = getattr(config, "_default", None)
        if isinstance(defaults, dict) and key in defaults:
            return getattr(config, key) == defaults[key]
        return getattr(config, key)
    return config._is_default(key)


#: The config entries that decide compiled random numbers, read through torch's
#: config API (value and default-ness: compile-cache keys see both).  A module
#: not imported counts as at its defaults (an import cannot be undone).
_COMPILED = {
    "torch._inductor.config": ("fallback_random", "align_random_eager", "batch_invariant"),
    "torch._functorch.config": ("functionalize_rng_ops", "graphsafe_rng_functionalization"),
    "torch._dynamo.config": ("use_numpy_random_stream",),
}


def _compiled() -> tuple[Any, ...]:
    import sys

    out: list[Any] = []
    for name, keys in _COMPILED.items():
        config = sys.modules.get(name)
        for key in keys:
            if _is_default(config, key) is True:
                out.append("default")
            else:
                out.append(getattr(config, key))
    return tuple(out)


def _read(get: Any) -> Any:
    # Some getters raise after mixed use of the legacy and new precision APIs.
    try:
        return get()
    except RuntimeError as exc:
        return f"raises {type(exc).__name__}"


def _defaults() -> tuple[Any, ...]:
    slot = torch._GLOBAL_DEVICE_CONTEXT
    ctx = (
        slot.__dict__.get("device_context", "absent") if isinstance(slot, threading.local) else slot
    )
    return (
        torch.get_default_dtype(),
        default_device(),
        ctx if ctx in ("absent", None) else id(ctx),  # never set / None / which context object
        torch._C._get_default_device(),  # the legacy set_default_tensor_type device
        torch.get_num_threads(),
        (torch.tensor([1e-310], dtype=torch.float64, device="cpu") * 1.0).item() == 0.0,  # flush
    )


@dataclass(frozen=True)
class World:
    random: Any
    numpy: Any
    torch_cpu: bytes
    cuda: Any
    flags: Any
    env: Any
    defaults: Any
    compiled: Any

    @classmethod
    def now(cls) -> World:
        cuda: Any
        if torch.cuda.is_initialized():
            cuda = tuple(
                torch.cuda.get_rng_state(i).numpy().tobytes()
                for i in range(torch.cuda.device_count())
            )
        else:
            # The lazily seeded devices whose queues the library manages on this torch.
            cuda = tuple(
                _lazy(module)
                for module in map(_torch.lazy_device, ("cuda", "xpu", "mtia"))
                if module is not None
            )
        return cls(
            random.getstate(),
            _np_state(),
            torch.get_rng_state().numpy().tobytes(),
            cuda,
            _flags(),
            tuple(os.environ.get(n) for n in ENV_NAMES),
            _defaults(),
            _compiled(),
        )

    def diff(self, other: World) -> list[str]:
        """The names of the parts that differ between ``self`` (before) and ``other``."""
        return [
            name
            for name in (
                "random",
                "numpy",
                "torch_cpu",
                "cuda",
                "flags",
                "env",
                "defaults",
                "compiled",
            )
            if getattr(self, name) != getattr(other, name)
            and not (name == "cuda" and _first_initialized(self.cuda, other.cuda))
        ]


def _first_initialized(before: Any, after: Any) -> bool:
    """CUDA initialized in between with no seed queued before: its generators were
    seeded from the OS's randomness, as torch's initialization always seeds them, so
    any state is what it would have been (a GPU test that moves a tensor to the
    device initializes CUDA, and that is no leak).  With a seed queued before, the
    state after is not checked here: tests/core/test_gpu.py checks that case itself."""
    if not (isinstance(after[0], bytes) and not isinstance(before[0], bytes)):
        return False
    seed_all, seed_one, order, _count = before[0]  # torch queues calls of its own too
    return seed_all is None and seed_one is None and not order
