"""The import path ``deterministic_ctx.ops``, kept.

It *is* :mod:`deterministic_ctx.verify.ops`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .verify.ops import *  # noqa: F403
else:
    from .verify import ops as module

    sys.modules[__name__] = module
