"""Seeds for multi-process training on ``torch.distributed``.

What is per rank and what is shared, under ``deterministic(seed=s, rank=...)``
and ``seed_everything(s, rank=...)``:

=====================================  =========================================
per rank (``rank_seed(s, rank)``)      shared (``s`` on every rank)
=====================================  =========================================
Python ``random``                      torch CPU generator (model initialization)
NumPy's global RNG                     CUDA / XPU / MTIA / MPS generators
registered user RNGs                   ``PYTHONHASHSEED`` for child processes
DataLoader workers (``seed_worker``)   ``DistributedSampler(seed=s)`` (pass it)
=====================================  =========================================

Model initialization must be identical on every rank, and it draws from torch's
generators, so they keep the shared seed.  Augmentation must differ, and it
draws from ``random``, NumPy, user RNGs and DataLoader workers, so they get
``rank_seed(s, rank)``: ``s`` itself on rank 0 (a one-process run draws what
rank 0 draws), a well-mixed ``derive_seed(s, "rank", rank)`` elsewhere, which
shares no structure with other seeds (``s + rank`` makes seed 0 rank 1 collide
with seed 1 rank 0).  To make torch ops such as dropout differ per rank, reseed
torch after building the model: ``torch.manual_seed(rank_seed(s))``.
"""

from __future__ import annotations

import secrets

import torch.distributed as dist

from .internal import Rank, process_rank, seed_for_rank, validate_rank, validate_seed

__all__ = ["broadcast_seed", "draw_seed", "rank_seed", "resolve_rank", "world_size"]


def resolve_rank(rank: Rank = "auto") -> int:
    """The rank ``rank`` stands for: itself if an int, 0 if ``None``, and for
    ``"auto"`` this process's rank in the initialized default process group
    (0 when there is none).

    Example:
        >>> from deterministic_ctx.distributed import resolve_rank
        >>> resolve_rank("auto")  # no process group here
        0
        >>> resolve_rank(3)
        3
    """
    rank = validate_rank(rank)
    if rank is None:
        return 0
    return process_rank() if rank == "auto" else rank


def rank_seed(seed: int, rank: Rank = "auto") -> int:
    """The per-rank seed a block with ``seed`` and ``rank`` gives ``random``,
    NumPy and user RNGs: ``seed`` on rank 0, a well-mixed sub-seed elsewhere.

    Example:
        >>> from deterministic_ctx.distributed import rank_seed
        >>> rank_seed(7, 0)
        7
        >>> rank_seed(7, 1) != rank_seed(8, 0)  # unlike seed + rank
        True
    """
    return seed_for_rank(validate_seed(seed), resolve_rank(rank))


def world_size() -> int:
    """The size of the initialized default process group, 1 without one (internal)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size())


def draw_seed() -> int:
    """A fresh 32-bit seed (internal: ``seed_everything(None)`` draws with it)."""
    # From the OS, never from a global RNG: inside a block that would repeat
    # the block's seed and shift its streams.
    return secrets.randbits(32)


def broadcast_seed(seed: int | None = None) -> int:
    """Rank 0's seed, on every rank: the one it passes, or a fresh one if ``None``.

    A collective: every rank of the default process group must call it.  The
    seeds other ranks pass are validated, then ignored.  Without an initialized
    process group it returns ``seed`` (or a fresh one), so one script serves
    one-process and multi-process runs.  Log or save the result to replay the
    run with a fixed seed.

    Example:
        >>> from deterministic_ctx import deterministic
        >>> from deterministic_ctx.distributed import broadcast_seed
        >>> with deterministic(seed=broadcast_seed(5), rank="auto") as det:
        ...     det.seed
        5
    """
    if seed is not None:
        seed = validate_seed(seed)
    if world_size() == 1:
        return draw_seed() if seed is None else seed
    box: list[int | None] = [None]
    if dist.get_rank() == 0:
        box[0] = draw_seed() if seed is None else seed
    # broadcast_object_list picks the device the backend needs (CPU for gloo,
    # the current CUDA device for NCCL).
    dist.broadcast_object_list(box, src=0)
    value = box[0]
    if not isinstance(value, int):  # only rank 0 writes it, and it writes an int
        raise RuntimeError(f"broadcast_seed received {value!r} from rank 0")
    return value
