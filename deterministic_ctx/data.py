"""The import path ``deterministic_ctx.data``, kept.

It *is* :mod:`deterministic_ctx.parallel.data`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .parallel.data import *  # noqa: F403
else:
    from .parallel import data as module

    sys.modules[__name__] = module
