"""The import path ``deterministic_ctx.snapshot``, kept.

It *is* :mod:`deterministic_ctx.state.snapshot`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .state.snapshot import *  # noqa: F403
else:
    from .state import snapshot as module

    sys.modules[__name__] = module
