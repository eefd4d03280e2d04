"""The import path ``deterministic_ctx.hypothesis``, kept.

It *is* :mod:`deterministic_ctx.integrations.hypothesis`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .integrations.hypothesis import *  # noqa: F403
else:
    from .integrations import hypothesis as module

    sys.modules[__name__] = module
