"""torch determinism and precision flags.

Applied inside a block (they choose *which* algorithm runs):

* ``torch.backends.cudnn.deterministic = True`` and ``.benchmark = False``;
* ``torch.use_deterministic_algorithms(True, warn_only=...)``: both booleans;
* ``torch.utils.deterministic.fill_uninitialized_memory = True``;
* ``torch.backends.mkldnn.deterministic = True``;
* ``torch._inductor.config.deterministic = True``, *only if inductor is
  already imported*: ``use_deterministic_algorithms`` imports it (~1.2 s) to
  set this; we call the C setter directly and never import it ourselves.

Captured and restored but never changed (they choose precision, and TF32
results are themselves deterministic): ``torch.get_float32_matmul_precision()``
and the ``fp32_precision`` of every backend/op.  They are read through the
new ``fp32_precision`` getters because the legacy ``allow_tf32`` getters raise
once the two APIs have been mixed.

``torch.backends.cudnn.flags()`` is not used: it defaults to ``enabled=False``
and would turn cuDNN off.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from .._settings import Settings

__all__ = ["FlagState", "TorchFlagsSource"]

_C: Any = torch._C

_PRECISION_OPS: tuple[tuple[str, str], ...] = tuple(
    pair
    for pair in (
        ("generic", "all"),
        ("cuda", "all"),
        ("cuda", "matmul"),
        ("cuda", "conv"),
        ("cuda", "rnn"),
        ("mkldnn", "all"),
        ("mkldnn", "matmul"),
        ("mkldnn", "conv"),
        ("mkldnn", "rnn"),
    )
    if hasattr(_C, "_get_fp32_precision_getter")
)


def _supported(pair: tuple[str, str]) -> bool:
    try:
        _C._get_fp32_precision_getter(*pair)
    except Exception:
        return False
    return True


_PRECISION_OPS = tuple(p for p in _PRECISION_OPS if _supported(p))


@dataclass(frozen=True)
class FlagState:
    """Every flag value; ``inductor_deterministic`` is ``None`` if not imported."""

    cudnn_deterministic: bool
    cudnn_benchmark: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    fill_uninitialized_memory: bool
    mkldnn_deterministic: bool
    inductor_deterministic: bool | None
    float32_matmul_precision: str
    fp32_precision: tuple[str, ...]


def _inductor_config() -> Any:
    return sys.modules.get("torch._inductor.config")


class TorchFlagsSource:
    """Algorithm-selection flags of torch, cuDNN, oneDNN and inductor."""

    name = "torch.flags"

    def capture(self) -> FlagState:
        inductor = _inductor_config()
        return FlagState(
            _C._get_cudnn_deterministic(),
            _C._get_cudnn_benchmark(),
            _C._get_deterministic_algorithms(),
            _C._get_deterministic_algorithms_warn_only(),
            _C._get_deterministic_fill_uninitialized_memory(),
            _C._get_mkldnn_deterministic(),
            None if inductor is None else bool(inductor.deterministic),
            _C._get_float32_matmul_precision(),
            tuple(_C._get_fp32_precision_getter(*op) for op in _PRECISION_OPS),
        )

    def apply(self, settings: Settings) -> None:
        _C._set_cudnn_deterministic(True)
        _C._set_cudnn_benchmark(False)
        _C._set_deterministic_algorithms(True, warn_only=settings.warn_only)
        _C._set_deterministic_fill_uninitialized_memory(True)
        _C._set_mkldnn_deterministic(True)
        inductor = _inductor_config()
        if inductor is not None:
            inductor.deterministic = True

    def restore(self, state: FlagState) -> None:
        # Only what differs is written: cheap, and it never mixes the legacy
        # and new precision APIs behind the user's back.
        now = self.capture()
        if now == state:
            return
        if now.cudnn_deterministic != state.cudnn_deterministic:
            _C._set_cudnn_deterministic(state.cudnn_deterministic)
        if now.cudnn_benchmark != state.cudnn_benchmark:
            _C._set_cudnn_benchmark(state.cudnn_benchmark)
        if (now.deterministic_algorithms, now.deterministic_warn_only) != (
            state.deterministic_algorithms,
            state.deterministic_warn_only,
        ):
            _C._set_deterministic_algorithms(
                state.deterministic_algorithms, warn_only=state.deterministic_warn_only
            )
        if now.fill_uninitialized_memory != state.fill_uninitialized_memory:
            _C._set_deterministic_fill_uninitialized_memory(state.fill_uninitialized_memory)
        if now.mkldnn_deterministic != state.mkldnn_deterministic:
            _C._set_mkldnn_deterministic(state.mkldnn_deterministic)
        inductor = _inductor_config()
        if inductor is not None:
            # Imported inside the block: its default is what it would have been.
            if state.inductor_deterministic is not None:
                inductor.deterministic = state.inductor_deterministic
        if now.float32_matmul_precision != state.float32_matmul_precision:
            torch.set_float32_matmul_precision(state.float32_matmul_precision)
        current = tuple(_C._get_fp32_precision_getter(*op) for op in _PRECISION_OPS)
        for op, was, is_ in zip(_PRECISION_OPS, state.fp32_precision, current):
            if was != is_:
                _C._set_fp32_precision_setter(*op, was)
