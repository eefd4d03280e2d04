"""The report's RNG section: one status per RNG, in the order :func:`rng_statuses` lists them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from .model import RngStatus

__all__ = ["TORCH_DEFAULT_SEED", "RngFacts", "rng_statuses"]

#: torch's fixed default seed of a fresh generator (CUDA default generators start from it).
TORCH_DEFAULT_SEED = 67280421310721
_BLOCK_SEEDED = "seeded on entry to the enclosing deterministic block"


@dataclasses.dataclass(frozen=True)
class RngFacts:
    """What every RNG family's status is judged from."""

    torch: Any
    np: Any
    snapshot: Any
    in_block: bool
    #: ``torch.initial_seed()``: the seed of torch's global generator.
    cpu_seed: int

    @property
    def chosen_seed(self) -> int | None:
        """The CPU seed when a program could have chosen it, else ``None``.

        An unseeded torch starts from a random 64-bit value, which falls in the
        range ``seed_everything`` and blocks accept (up to ``MAX_SEED``, 32 bits)
        with odds of 1 in 2**32: a seed in that range was chosen.
        """
        from ..internal import MAX_SEED

        return self.cpu_seed if self.cpu_seed <= MAX_SEED else None


def _fresh_python_state(seed: int) -> bool:
    import random

    return random.getstate() == random.Random(seed).getstate()


def _fresh_numpy_state(np: Any, seed: int) -> bool:
    state = np.random.get_state(legacy=False)
    if state["bit_generator"] != "MT19937":
        return False
    ref = np.random.RandomState(seed).get_state(legacy=False)
    return bool(
        state["state"]["pos"] == ref["state"]["pos"]
        and state["has_gauss"] == ref["has_gauss"]
        and (state["state"]["key"] == ref["state"]["key"]).all()
    )


def _mersenne_status(name: str, facts: RngFacts, fresh: Callable[[int], bool]) -> RngStatus:
    """Python's or NumPy's global Mersenne Twister.

    Its state cannot be traced back to a seed, so the only evidence of seeding
    is a state equal to the one seeding with torch's seed gives (what
    ``seed_everything`` does), before any draw.
    """
    if facts.in_block:  # seeded with the block's seed, or a per-rank seed derived from it
        return RngStatus(name, True, None, _BLOCK_SEEDED)
    seed = facts.chosen_seed
    if seed is not None and fresh(seed):
        detail = "in the state seeding with torch's seed gives; no draws since"
        return RngStatus(name, True, seed, detail)
    return RngStatus(name, None, None, "its state cannot tell whether or how it was seeded")


def _numpy_rng(facts: RngFacts) -> RngStatus:
    np = facts.np
    status = _mersenne_status("numpy", facts, functools.partial(_fresh_numpy_state, np))
    if np.random.mtrand._rand._bit_generator.__class__.__name__ != "MT19937":
        replaced = status.detail + "; the global bit generator was replaced"
        status = dataclasses.replace(status, detail=replaced)
    return status


def _torch_cpu_rng(facts: RngFacts) -> RngStatus:
    if facts.in_block:
        return RngStatus("torch.cpu", True, facts.cpu_seed, _BLOCK_SEEDED)
    if facts.chosen_seed is not None:
        detail = "torch.initial_seed() is a seed a program chose"
        return RngStatus("torch.cpu", True, facts.cpu_seed, detail)
    detail = "torch.initial_seed() is a random 64-bit startup value: never seeded"
    return RngStatus("torch.cpu", False, facts.cpu_seed, detail)


def _cuda_rng(facts: RngFacts) -> tuple[RngStatus, ...]:
    """The CUDA default generators: read once CUDA started, else what they will start from.

    Reading the generators of a CUDA not started would start it, so the snapshot
    tells instead.  Nothing on a build without CUDA.
    """
    torch = facts.torch
    if torch.cuda.is_initialized():
        seeds = [int(g.initial_seed()) for g in torch.cuda.default_generators]
        seeded = facts.in_block or any(s != TORCH_DEFAULT_SEED for s in seeds)
        detail = f"initial seed per device: {seeds}"
        detail += "" if seeded else " (torch's fixed default)"
        unique = seeds[0] if len(set(seeds)) == 1 else None
        return (RngStatus("torch.cuda", seeded, unique, detail),)
    if not torch.backends.cuda.is_built() or "torch.cuda" not in facts.snapshot.sources:
        return ()
    lazy = facts.snapshot.state_of("torch.cuda")
    queued = any(getattr(lazy, name, None) is not None for name in ("seed_all", "seed_one"))
    if facts.in_block:
        detail = "not initialized; if CUDA starts inside the block it starts from the block's seed"
    elif queued:
        detail = "not initialized; a queued seed applies when CUDA starts"
    else:
        detail = (
            f"not initialized; it would start from torch's fixed default seed {TORCH_DEFAULT_SEED}"
        )
    return (RngStatus("torch.cuda", facts.in_block or queued, None, detail),)


def _user_rngs(facts: RngFacts) -> tuple[RngStatus, ...]:
    from ..internal import registered_rngs

    return tuple(
        RngStatus(
            f"user:{key}",
            True if facts.in_block else None,
            None,
            f"registered {type(obj).__qualname__}, seeded inside every deterministic block",
        )
        for key, obj in registered_rngs()
    )


def rng_statuses(torch: Any, np: Any, snapshot: Any, in_block: bool) -> tuple[RngStatus, ...]:
    """The RNG section, in report order (CUDA's only on a build with CUDA)."""
    facts = RngFacts(torch, np, snapshot, in_block, int(torch.initial_seed()))
    return (
        _mersenne_status("random", facts, _fresh_python_state),
        _numpy_rng(facts),
        _torch_cpu_rng(facts),
        *_cuda_rng(facts),
        *_user_rngs(facts),
    )
