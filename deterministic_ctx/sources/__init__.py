"""Sources of process-global state: one adapter per RNG or group of flags.

``SOURCES`` is the ordered tuple every snapshot captures.  Adding a device or
a flag means adding or changing one module here, nothing above it.
"""

from __future__ import annotations

from ..base import seed as _seed
from ..base import settings as _settings
from ..base.cache import BoundedCache
from ..base.fast_paths import ENABLED
from ..base.settings import Settings
from ._base import DeviceSource, Reseeder, Source, seeds_nothing
from .accelerators import accelerator_sources
from .compiler import TorchCompileSource
from .environ import EnvironSource
from .flags import TorchFlagsSource
from .numpy_global import NumpyGlobalSource
from .python_random import PythonRandomSource
from .torch_cpu import TorchCPUSource
from .torch_defaults import TorchDefaultsSource
from .user_rngs import (
    UserRngSource,
    register_rng,
    registered_rngs,
    seed_registered_rngs,
    unregister_rng,
)

__all__ = [
    "SOURCES",
    "DeviceSource",
    "Source",
    "apply_all",
    "fast_paths",
    "generator_sources",
    "register_rng",
    "registered_rngs",
    "reseeding",
    "seed_registered_rngs",
    "source_named",
    "unregister_rng",
]

SOURCES: tuple[Source, ...] = (
    PythonRandomSource(),
    NumpyGlobalSource(),
    TorchCPUSource(),
    *accelerator_sources(),
    TorchFlagsSource(),
    TorchCompileSource(),
    TorchDefaultsSource(),
    EnvironSource(),
    UserRngSource(),
)


def apply_all(settings: Settings, sources: tuple[Source, ...]) -> None:
    """Apply the block's settings to each of ``sources`` (the caller rolls back on error).

    Sources that say they apply nothing (:attr:`Source.applies_nothing`:
    torch's defaults, a device this build can never initialize) are skipped,
    a frame each per block.
    """
    global _appliers
    settings = settings.resolved()
    found = _appliers  # read once: another thread may replace it
    if found[0] is not sources:
        found = _appliers = (sources, tuple(s for s in sources if not s.applies_nothing))
    for source in found[1]:
        source.apply(settings)


#: ``(sources, those of them whose apply may do something)``, for the tuple seen last.
_appliers: tuple[tuple[Source, ...], tuple[Source, ...]] = ((), ())


def reseeding(sources: tuple[Source, ...]) -> tuple[tuple[Reseeder, ...], tuple[Source, ...]]:
    """How to seed ``sources`` afresh at each step (``Block.reseed``): the
    reseeders of those that have one (not those that seed nothing), and the
    sources whose ``apply`` must run instead (not those that apply nothing).
    Worked out once per tuple of sources (the last few are kept)."""
    plan = _reseeding.get(sources)
    if plan is None:
        fast: list[Reseeder] = []
        slow: list[Source] = []
        for source in sources:
            if source.applies_nothing:
                continue
            reseeder = source.reseeder()
            if reseeder is None:
                slow.append(source)
            elif reseeder is not seeds_nothing:
                fast.append(reseeder)
        plan = (tuple(fast), tuple(slow))
        _reseeding.put(sources, plan)
    return plan


#: ``reseeding``'s plans, by tuple of sources.
_reseeding: BoundedCache[tuple[Source, ...], tuple[tuple[Reseeder, ...], tuple[Source, ...]]] = (
    BoundedCache(8)
)


def generator_sources() -> tuple[Source, ...]:
    """The sources of generator state that torch and the user own: torch's CPU
    generator, every device type's, and the registered RNGs (not ``random``
    and NumPy, nor flags).  What an integration reseeds next to another tool
    that manages ``random`` and NumPy itself (pytest-randomly, Hypothesis)."""
    return (
        source_named("torch.cpu"),  # a KeyError, not silence, should a name change
        *(source for source in SOURCES if source.device_type is not None),
        source_named("user"),
    )


def source_named(name: str) -> Source:
    """The source of :data:`SOURCES` called ``name`` (``"torch.flags"``, ...)."""
    for source in SOURCES:
        if source.name == name:
            return source
    raise KeyError(f"no source named {name!r}; there are: {', '.join(s.name for s in SOURCES)}")


def fast_paths() -> dict[str, bool]:
    """Which fast paths this process uses, by what each one speeds up.

    Built from what each source declares (:attr:`Source.fast_paths`; the
    registered RNGs' source declares its kinds', :mod:`.rngs.kinds`); each is
    chosen once, at import, or at first use for a layout probed then, and
    only where its layout was proven (:mod:`.rngs.layouts`).
    ``DETERMINISTIC_CTX_NO_FAST_PATHS=1`` turns every one off.

    Example:
        >>> from deterministic_ctx.sources import fast_paths
        >>> "random.Random: state copied as memory" in fast_paths()
        True
    """
    own = (_settings.FAST_PATH, _seed.FAST_PATH)
    paths = (*own, *(path for s in SOURCES for path in s.fast_paths))
    return {path.what: ENABLED and path.used() for path in paths}
