"""The import path ``deterministic_ctx.dcp``, kept.

It *is* :mod:`deterministic_ctx.state.dcp`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state.dcp import *  # noqa: F403
else:
    from .state import dcp as module

    sys.modules[__name__] = module
