"""The import path ``deterministic_ctx.distributed``, kept.

It *is* :mod:`deterministic_ctx.parallel.ranks`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .parallel.ranks import *  # noqa: F403
else:
    from .parallel import ranks as module

    sys.modules[__name__] = module
