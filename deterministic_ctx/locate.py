"""The import path ``deterministic_ctx.locate``, kept.

It *is* :mod:`deterministic_ctx.verify.locate`: one module object, so patching either
patches both.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .verify.locate import *  # noqa: F403
else:
    from .verify import locate as module

    sys.modules[__name__] = module
