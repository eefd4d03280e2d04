"""Shared helpers for the tests."""

from __future__ import annotations

import random

import numpy as np
import torch

#: Every tensor dtype the verification tools must compare bit for bit.
TENSOR_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)


def draw() -> tuple[float, float, float]:
    """One draw from each global RNG."""
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def solo(seed: int, n: int) -> list[tuple[float, float, float]]:
    """What ``n`` draws inside a fresh block with ``seed`` give."""
    from deterministic_ctx import deterministic

    with deterministic(seed=seed):
        return [draw() for _ in range(n)]
