"""torch's default CPU generator."""

from __future__ import annotations

import torch

from .._settings import Settings

__all__ = ["TorchCPUSource"]


class TorchCPUSource:
    """``torch.default_generator``, used by every CPU op without ``generator=``."""

    name = "torch.cpu"

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self._gen = generator if generator is not None else torch.default_generator

    def capture(self) -> torch.Tensor:
        return self._gen.get_state()  # a fresh ByteTensor copy, never handed out

    def restore(self, state: torch.Tensor) -> None:
        self._gen.set_state(state)

    def apply(self, settings: Settings) -> None:
        # What ``torch.manual_seed`` does for the CPU; accelerators are their
        # own sources so that no lazy seed with a formatted stack is queued.
        self._gen.manual_seed(settings.seed)
