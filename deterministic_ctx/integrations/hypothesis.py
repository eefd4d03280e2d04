"""Let Hypothesis manage torch's global generators and the registered RNGs.

Hypothesis seeds Python's ``random`` and NumPy's global RNG before every example
of a ``@given`` test and restores them afterwards, but knows nothing of torch: a
test that draws from ``torch.rand`` gets other numbers each time an example is
replayed, and Hypothesis reports it as flaky.  :func:`register` hands Hypothesis
a :class:`TorchRandom`, a ``random.Random``-like view of torch's CPU generator,
every accelerator's generators and the RNGs registered with
:func:`~deterministic_ctx.register_rng`, through Hypothesis' own
``hypothesis.register_random``.  Call it once, for instance in ``conftest.py``::

    import deterministic_ctx.integrations.hypothesis

    deterministic_ctx.integrations.hypothesis.register()

It is an explicit call, not Hypothesis' ``hypothesis`` entry point, on purpose:
that entry point runs whenever Hypothesis is imported, in every project of the
environment.  Registering there would import torch (a second or more) into test
suites that never use it, and would change how every project's ``@given`` tests
draw from torch merely because deterministic-ctx is installed.

Example:
    >>> import torch
    >>> import deterministic_ctx.integrations.hypothesis
    >>> from hypothesis import given, strategies as st
    >>> _ = deterministic_ctx.integrations.hypothesis.register()
    >>> drawn = []
    >>> @given(st.integers())
    ... def test_noise(n):
    ...     drawn.append(torch.rand(1).item())
    >>> before = torch.get_rng_state()
    >>> test_noise()
    >>> len(set(drawn))  # every example starts from the same torch state
    1
    >>> torch.equal(torch.get_rng_state(), before)  # and the caller's stream is untouched
    True
    >>> deterministic_ctx.integrations.hypothesis.unregister()
"""

from __future__ import annotations

import threading

from ..internal import Block, Settings, World, generator_sources

__all__ = ["TorchRandom", "register", "unregister"]

#: torch's CPU generator, every accelerator source and the registered RNGs: a fixed tuple.
_SOURCES = generator_sources()


class TorchRandom:
    """torch's global generators and the registered RNGs, as one ``random.Random``-like object.

    ``seed(n)`` seeds them as a ``deterministic(seed=n)`` block does on entry (torch's CPU
    generator as ``torch.manual_seed(n)``, accelerators lazily, without initializing CUDA;
    each registered RNG with ``derive_seed(n, "user", key)``); ``getstate()`` captures them
    and ``setstate(state)`` puts them back bit for bit.  Python's ``random``, NumPy, the flags
    and the environment are not touched: Hypothesis manages the first two itself.

    While disabled (see :func:`unregister`), ``seed`` does nothing and ``getstate`` returns
    ``None``, which ``setstate`` ignores; a state captured before is still restored.

    Example:
        >>> import torch
        >>> rng = TorchRandom()
        >>> before = torch.get_rng_state()
        >>> state = rng.getstate()
        >>> rng.seed(3)
        >>> a = torch.rand(2)
        >>> _ = torch.manual_seed(3)
        >>> torch.equal(a, torch.rand(2))
        True
        >>> rng.setstate(state)
        >>> torch.equal(torch.get_rng_state(), before)
        True
    """

    __slots__ = ("__weakref__", "enabled")

    def __init__(self) -> None:
        self.enabled = True

    def seed(self, seed: int) -> None:
        """Seed every managed generator as a ``deterministic(seed=seed)`` block does.

        ``seed`` is an int in ``0 .. 2**32 - 1`` (Hypothesis passes ``0``, or the seed drawn
        by ``st.random_module()``); ``TypeError`` / ``ValueError`` otherwise.

        Example:
            >>> import torch
            >>> rng = TorchRandom()
            >>> state = rng.getstate()
            >>> rng.seed(0)
            >>> a = torch.rand(1)
            >>> rng.seed(0)
            >>> torch.equal(a, torch.rand(1))
            True
            >>> rng.setstate(state)
        """
        if not self.enabled:
            return
        # A block over these sources that keeps what it applied: the engine's lock,
        # and nothing half-seeded if a source fails (it rolls back).
        block = Block(Settings.build(seed, False), _SOURCES)
        block.start()
        block.commit()

    def getstate(self) -> World | None:
        """The state of every managed generator now (``None`` while disabled).

        Example:
            >>> import torch
            >>> rng = TorchRandom()
            >>> state = rng.getstate()
            >>> a = torch.rand(1)
            >>> rng.setstate(state)
            >>> torch.equal(a, torch.rand(1))
            True
            >>> rng.setstate(state)
        """
        if not self.enabled:
            return None
        return World.capture(_SOURCES)

    def setstate(self, state: World | None) -> None:
        """Put back a state from :meth:`getstate`, bit for bit; ``None`` does nothing.

        Example:
            >>> import torch
            >>> rng = TorchRandom()
            >>> state = rng.getstate()
            >>> a = torch.rand(5)
            >>> rng.setstate(state)
            >>> torch.equal(a, torch.rand(5))
            True
            >>> rng.setstate(state)
        """
        if state is None:
            return
        if type(state) is not World or state.sources != _SOURCES:
            raise TypeError(
                f"setstate() takes a state returned by TorchRandom.getstate(), got "
                f"{type(state).__name__}"
            )
        # The engine's restore: in reverse capture order, completed if interrupted,
        # every source tried before a RestoreError names those that failed.
        state.restore()

    def __repr__(self) -> str:
        names = ", ".join(source.name for source in _SOURCES)
        return f"<TorchRandom ({names}){'' if self.enabled else ' disabled'}>"


#: The one adapter handed to Hypothesis.  Hypothesis holds registered randoms by weak
#: reference only: this global keeps it alive for the life of the process.
_ADAPTER: TorchRandom | None = None
_lock = threading.Lock()


def register() -> TorchRandom:
    """Make Hypothesis seed and restore torch's generators and the registered RNGs.

    Registers a :class:`TorchRandom` with ``hypothesis.register_random``: before each
    example Hypothesis captures its state and seeds it (with ``0``, or with the seed
    ``st.random_module()`` draws), afterwards it restores it.  So a ``@given`` test that draws
    from ``torch.rand`` draws the same numbers each time an example is replayed, and leaves
    the caller's torch stream as it was.  Idempotent: returns the same adapter every time.
    Needs Hypothesis installed (``ModuleNotFoundError`` otherwise).

    Do not also pass an RNG registered with :func:`~deterministic_ctx.register_rng` to
    ``hypothesis.register_random``: Hypothesis restores its randoms in registration order,
    not in reverse, so of two managers of one object the second would restore a seeded state.

    Example:
        >>> import deterministic_ctx.integrations.hypothesis as dch
        >>> dch.register() is dch.register()
        True
        >>> dch.unregister()
    """
    import hypothesis  # here, not at module import: TorchRandom alone needs no Hypothesis

    global _ADAPTER
    with _lock:
        if _ADAPTER is None:
            _ADAPTER = TorchRandom()
        _ADAPTER.enabled = True
        # Hypothesis ignores an object it already manages.
        hypothesis.register_random(_ADAPTER)
        return _ADAPTER


def unregister() -> None:
    """Stop Hypothesis managing torch's generators; a no-op if :func:`register` was never called.

    Hypothesis has no way to unregister a random, so the adapter stays registered but inert:
    it seeds nothing and captures nothing.  :func:`register` turns it back on.

    Example:
        >>> import deterministic_ctx.integrations.hypothesis as dch
        >>> rng = dch.register()
        >>> dch.unregister()
        >>> rng.getstate() is None
        True
    """
    with _lock:
        if _ADAPTER is not None:
            _ADAPTER.enabled = False
