"""pytest-randomly's reseed, extended to torch and the registered RNGs.

pytest-randomly reseeds Python's ``random`` and NumPy's global RNG before every
test (and at setup, teardown, session start and collection), then calls every
function of the ``pytest_randomly.random_seeder`` entry-point group with the
same seed.  deterministic-ctx registers :func:`reseed` there, so with both
installed, ``--randomly-seed=N`` also decides torch's numbers in unmarked
tests.  Tests marked ``@pytest.mark.deterministic`` keep their block's numbers:
the pytest plugin puts the block's state back after pytest-randomly's reseed.

pytest-randomly imports this module and calls :func:`reseed` at session start,
before any test module is collected, in every project of the environment.  So
it imports nothing until torch has been imported by someone else: a test
suite that never uses torch never loads it.

Example:
    >>> from deterministic_ctx import Snapshot
    >>> from deterministic_ctx.integrations.randomly import reseed
    >>> import torch
    >>> before = Snapshot.capture()
    >>> reseed(1234)
    >>> a = torch.rand(2)
    >>> _ = torch.manual_seed(1234)
    >>> torch.equal(a, torch.rand(2))
    True
    >>> before.restore()
"""

from __future__ import annotations

import sys

__all__ = ["reseed"]

#: NumPy's legacy seeder takes 32 bits, and pytest-randomly hands it ``seed % 2**32``; torch
#: gets the same value, so one seed means the same thing to every global RNG.
_SEED_RANGE = 2**32


def reseed(seed: int) -> None:
    """Seed torch's CPU generator, every accelerator and the registered RNGs, as pytest-randomly
    seeds ``random`` and NumPy.

    The ``pytest_randomly.random_seeder`` entry point of deterministic-ctx: pytest-randomly
    calls it with its per-test seed.  ``seed`` is reduced modulo ``2**32`` (pytest-randomly
    seeds NumPy with ``seed % 2**32`` too), then applied exactly as a ``deterministic(seed)``
    block applies it on entry: torch's CPU generator gets ``torch.manual_seed``'s state, the
    accelerators are seeded lazily, as ``torch.manual_seed`` seeds them but without the stack
    trace it formats each time (~200 µs; CUDA is never initialized), and each registered RNG
    gets ``derive_seed(seed, "user", key)``.  About 5 µs in all.  Nothing is restored: it
    reseeds, like pytest-randomly.

    Before torch is imported it does nothing, and imports nothing: torch starts from its fixed
    default seed when it is first imported, and no RNG can be registered before that.

    Example:
        >>> from deterministic_ctx import Snapshot
        >>> import torch
        >>> before = Snapshot.capture()
        >>> reseed(7)
        >>> a = torch.rand(3)
        >>> reseed(2**32 + 7)  # the same seed, modulo 2**32
        >>> torch.equal(a, torch.rand(3))
        True
        >>> before.restore()
    """
    if "torch" not in sys.modules:
        return
    # Hypothesis' adapter seeds exactly what this reseeds (it imports no Hypothesis).
    from .hypothesis import TorchRandom

    TorchRandom().seed(seed % _SEED_RANGE)
