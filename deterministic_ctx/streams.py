"""The import path ``deterministic_ctx.streams``, kept.

It *is* :mod:`deterministic_ctx.parallel.streams`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .parallel.streams import *  # noqa: F403
else:
    from .parallel import streams as module

    sys.modules[__name__] = module
