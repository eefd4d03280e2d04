"""The internal API: what the integrations use besides the public one.

The integrations (``seeding``, ``data``, ``distributed``, ``verify``,
``locate`` and their parts, ``report``, ``cli``, ``ipython`` and the pytest
plugin) import from the public modules (:mod:`~deterministic_ctx.core.context`,
:mod:`~deterministic_ctx.core.decorate`, :mod:`~deterministic_ctx.state.snapshot`,
:mod:`~deterministic_ctx.state.checkpoint`) and from here, never from the engine,
the sources or a private module directly; ``lint-imports`` (the contracts in
the repository's ``.importlinter``) fails the build otherwise.  Changing an
integration therefore needs nothing beyond this page, and the engine can
change behind it.

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

from ._torch import (
    DCP_STATEFUL,
    TorchFeatureError,
    accelerator_type,
    default_device,
    is_compiling,
    missing_capabilities,
    release_of,
)
from ._torch.distributed import launcher_variables, process_rank
from ._torch.flags import current_autograd_node
from ._torch.internals import (
    AUTOGRAD_ENGINE_ENTRIES,
    BATCH_NORM_BASE,
    DROPOUT_BASE,
    DYNAMO,
    DYNAMO_CONFIG,
    INDUCTOR,
    INDUCTOR_CONFIG,
    TORCH_MACHINERY,
    UnwrappedDispatchMode,
    bad_fork_check,
    compiled_in_place,
    compiled_original,
    current_dispatch_mode,
    dynamo_disable,
    dynamo_disable_message,
    foreach_copy_,
    import_dynamo,
    inductor_config,
    inductor_mode_options,
    node_sequence_nr,
)
from .base.seed import MAX_SEED, derive_seed, validate_seed
from .base.settings import (
    AUTO,
    CompiledRng,
    Rank,
    Settings,
    check_bool,
    seed_for_rank,
    validate_compiled_rng,
    validate_rank,
)
from .base.version import __version__ as VERSION
from .core.engine import Block, inside_block, opaque
from .core.exempt import active_exemptions, exempted_calls, is_exempted
from .sources import (
    fast_paths,
    generator_sources,
    register_rng,
    registered_rngs,
    seed_registered_rngs,
    source_named,
)
from .sources.config_entries import unchanged_config
from .base.plain import fields as plain_fields
from .base.plain import flag as plain_flag
from .base.plain import integer as plain_integer
from .base.plain import mapping as plain_mapping
from .base.plain import shown as plain_shown
from .sources.compiler import compiled_settings
from .sources.environ import CUBLAS_VALID, export_env_var, managed_env_vars, register_env_var
from .sources.environ import SEED as SEED_ENV_VAR
from .sources.flags import PRECISION_OPS, UNSUPPORTED_FLAGS

__all__ = [
    "AUTO",
    "AUTOGRAD_ENGINE_ENTRIES",
    "BATCH_NORM_BASE",
    "CUBLAS_VALID",
    "DCP_STATEFUL",
    "DROPOUT_BASE",
    "DYNAMO",
    "DYNAMO_CONFIG",
    "INDUCTOR",
    "INDUCTOR_CONFIG",
    "MAX_SEED",
    "PRECISION_OPS",
    "SEED_ENV_VAR",
    "TORCH_MACHINERY",
    "UNSUPPORTED_FLAGS",
    "VERSION",
    "Block",
    "CompiledRng",
    "Rank",
    "Settings",
    "TorchFeatureError",
    "UnwrappedDispatchMode",
    "accelerator_type",
    "active_exemptions",
    "bad_fork_check",
    "check_bool",
    "compiled_in_place",
    "compiled_original",
    "compiled_settings",
    "current_autograd_node",
    "current_dispatch_mode",
    "default_device",
    "derive_seed",
    "dynamo_disable",
    "dynamo_disable_message",
    "exempted_calls",
    "export_env_var",
    "fast_paths",
    "foreach_copy_",
    "generator_sources",
    "import_dynamo",
    "inductor_config",
    "inductor_mode_options",
    "inside_block",
    "is_compiling",
    "is_exempted",
    "launcher_variables",
    "managed_env_vars",
    "missing_capabilities",
    "node_sequence_nr",
    "opaque",
    "plain_fields",
    "plain_flag",
    "plain_integer",
    "plain_mapping",
    "plain_shown",
    "process_rank",
    "register_env_var",
    "register_rng",
    "registered_rngs",
    "release_of",
    "seed_for_rank",
    "seed_registered_rngs",
    "source_named",
    "unchanged_config",
    "validate_compiled_rng",
    "validate_rank",
    "validate_seed",
]
