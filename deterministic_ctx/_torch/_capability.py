"""A capability: one piece of torch's private or version-dependent API, probed once.

Kept free of torch at import: a probe imports what it reads when it first runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import PUBLIC_MODULE, DeterministicCtxError

__all__ = [
    "Capability",
    "ProbeLater",
    "TorchFeatureError",
    "missing_capabilities",
]

_UNPROBED: Any = object()


class ProbeLater(DeterministicCtxError):
    """Raised by a probe that could only answer by importing a module that is not
    imported yet (``torch._inductor``): the capability reads as missing for now
    and is probed again at its next use."""


class TorchFeatureError(DeterministicCtxError, RuntimeError):
    """A block option, or another explicit request, needs an API this torch lacks.

    The message names what was asked for, what torch would need to have, and
    the torch version that first had it.

    Example:
        >>> raise TorchFeatureError("compiled_rng='eager' needs X (torch >= 2.2); ...")
        Traceback (most recent call last):
        ...
        deterministic_ctx.TorchFeatureError: compiled_rng='eager' ...
    """

    __module__ = PUBLIC_MODULE


class Capability:
    """One named piece of torch's API that not every supported torch has.

    ``probe`` runs once, at the first :attr:`value` or :attr:`available`, and
    returns what the library uses (a callable, a module, ...) or ``None``
    where this torch lacks it.  ``reads`` says which torch attributes it
    reads, ``since`` the first torch version known to have it, ``fallback``
    what the library does without it (one line of :func:`~deterministic_ctx.report`).

    ``quiet`` capabilities depend on the *build* (an XPU-only flag), not on
    the version: their absence is normal and not reported.
    """

    __slots__ = ("_probe", "_value", "fallback", "name", "quiet", "reads", "since")

    def __init__(
        self,
        name: str,
        *,
        reads: str,
        since: str,
        fallback: str,
        probe: Callable[[], Any],
        quiet: bool = False,
    ) -> None:
        self.name = name
        self.reads = reads
        self.since = since
        self.fallback = fallback
        self.quiet = quiet
        self._probe = probe
        self._value: Any = _UNPROBED
        _REGISTRY[name] = self

    @property
    def value(self) -> Any:
        """What the probe found (``None``: this torch lacks it)."""
        value = self._value
        if value is _UNPROBED:
            try:
                value = self._probe()
            except ProbeLater:
                return None
            except (ImportError, AttributeError, RuntimeError):
                value = None
            self._value = value
        return value

    @property
    def available(self) -> bool:
        """Whether this torch has it."""
        return self.value is not None

    @property
    def probed(self) -> bool:
        """Whether the probe has run (a report lists only what was asked for)."""
        return self._value is not _UNPROBED

    def require(self, what: str) -> Any:
        """The value, or :class:`TorchFeatureError` saying that ``what`` needs it."""
        value = self.value
        if value is None:
            import torch

            raise TorchFeatureError(
                f"{what} needs {self.reads} (torch >= {self.since}), which torch "
                f"{torch.__version__} does not have"
            )
        return value

    def describe(self) -> str:
        """The report's line: what is off, and which torch has it."""
        return f"{self.name}: off: {self.fallback} (needs {self.reads}, torch >= {self.since})"

    def __repr__(self) -> str:
        state = "unprobed" if not self.probed else "available" if self.available else "missing"
        return f"<Capability {self.name}: {state}>"


_REGISTRY: dict[str, Capability] = {}


def missing_capabilities() -> tuple[Capability, ...]:
    """The capabilities this torch lacks, probing each (quiet ones left out, and
    those that cannot be probed yet without an import: see :class:`ProbeLater`)."""
    return tuple(c for c in _REGISTRY.values() if not c.quiet and c.value is None and c.probed)
