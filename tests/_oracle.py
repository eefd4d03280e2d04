"""An independent view of global random state, built only from public APIs.

Tests compare against this rather than against ``Snapshot``, so a bug in the
library's own capture cannot hide a bug in its restore.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

ENV_NAMES = ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED")


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
    return (t.manual_seed_all_cb, t.manual_seed_cb, tuple(t.call_order), len(module._queued_calls))


def _flags() -> tuple[Any, ...]:
    import sys

    inductor = sys.modules.get("torch._inductor.config")
    return (
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.mkldnn.deterministic,
        # An import cannot be undone: "not imported" counts as its default.
        (os.getenv("TORCHINDUCTOR_DETERMINISTIC") == "1") if inductor is None else inductor.deterministic,
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.mkldnn.fp32_precision,
    )


@dataclass(frozen=True)
class World:
    random: Any
    numpy: Any
    torch_cpu: bytes
    cuda: Any
    flags: Any
    env: Any

    @classmethod
    def now(cls) -> World:
        cuda: Any
        if torch.cuda.is_initialized():
            cuda = tuple(torch.cuda.get_rng_state(i).numpy().tobytes() for i in range(torch.cuda.device_count()))
        else:
            cuda = (_lazy(torch.cuda), _lazy(torch.xpu), _lazy(torch.mtia))
        return cls(
            random.getstate(),
            _np_state(),
            torch.get_rng_state().numpy().tobytes(),
            cuda,
            _flags(),
            tuple(os.environ.get(n) for n in ENV_NAMES),
        )

    def diff(self, other: World) -> list[str]:
        return [
            name
            for name in ("random", "numpy", "torch_cpu", "cuda", "flags", "env")
            if getattr(self, name) != getattr(other, name)
        ]
