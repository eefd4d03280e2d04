"""The internal API: the engine's parts that the layers above it use, and nothing else.

The layers above the engine (``parallel``, ``state``, ``verify``, ``reporting``,
``audit``, ``trace`` and the integrations) import the public modules
(:mod:`~deterministic_ctx.core.context`, :mod:`~deterministic_ctx.state.snapshot`,
...), the foundation every layer may use (:mod:`deterministic_ctx._torch`, torch's
private and version-dependent API; :mod:`deterministic_ctx.base.plain`, checked
reading of saved data; :mod:`deterministic_ctx.base.version`) and this module;
never the engine's parts (``core.engine``, ``core.world``, ``sources``, the rest
of ``base``) directly.  ``lint-imports`` (the contracts in the repository's
``.importlinter``) fails the build otherwise.

So this is the engine's explicit API, in five groups: blocks; seeds and a
block's settings; the completion step; the sources' registries and the facts
the report shows; the exempted calls.  Each name is here because a module
above uses it (a test in ``tests/test_layout.py`` checks that, and that there
are at most 30), and each comes from a public (not ``_``-prefixed) module
below, so that nothing private leaks upwards through this page.

Not for users: names here may change in any release.

Example:
    >>> from deterministic_ctx.internal import Block, Settings, inside_block
    >>> block = Block(Settings.build(0, False))
    >>> block.start()
    >>> inside_block()
    True
    >>> block.stop()
    >>> inside_block()
    False
"""

from __future__ import annotations

# The completion step: an undo finished even if something stops it, then re-raised.
from .base.completion import complete

# Seeds and a block's settings, validated.
from .base.seed import MAX_SEED, derive_seed, validate_seed
from .base.settings import CompiledRng, Rank, Settings, check_bool, validate_rank

# Blocks: the engine's one way in and out.
from .core.engine import Block, drain_signals, inside_block

# Exempted calls (allow_nondeterministic): what the checks above must not count.
from .core.exempt import active_exemptions, exempted_calls, is_exempted

# A world: the captured state of every source, or of some (what a block restores).
from .core.world import World

# The sources: registered RNGs, the sources by name, what the report shows of them.
from .sources import (
    fast_paths,
    generator_sources,
    register_rng,
    registered_rngs,
    seed_registered_rngs,
    source_named,
)
from .sources.compiler import compiled_settings
from .sources.config_entries import unchanged_config
from .sources.environ import CUBLAS_VALID, export_env_var, managed_env_vars
from .sources.environ import SEED as SEED_ENV_VAR
from .sources.flags import PRECISION_OPS, UNSUPPORTED_FLAGS

__all__ = [
    "CUBLAS_VALID",
    "MAX_SEED",
    "PRECISION_OPS",
    "SEED_ENV_VAR",
    "UNSUPPORTED_FLAGS",
    "Block",
    "CompiledRng",
    "Rank",
    "Settings",
    "World",
    "active_exemptions",
    "check_bool",
    "compiled_settings",
    "complete",
    "derive_seed",
    "drain_signals",
    "exempted_calls",
    "export_env_var",
    "fast_paths",
    "generator_sources",
    "inside_block",
    "is_exempted",
    "managed_env_vars",
    "register_rng",
    "registered_rngs",
    "seed_registered_rngs",
    "source_named",
    "unchanged_config",
    "validate_rank",
    "validate_seed",
]
