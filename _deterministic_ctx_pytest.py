"""The pytest plugin's old import path, kept for warning filters and ``-p`` options.

The plugin is :mod:`deterministic_ctx.integrations.pytest_plugin`; this name *is*
that module (one object), so ``-W error::_deterministic_ctx_pytest.DeterministicLeakWarning``
keeps working.  Like the plugin, it imports neither torch nor NumPy.
"""

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deterministic_ctx.integrations.pytest_plugin import *  # noqa: F403
else:
    from deterministic_ctx.integrations import pytest_plugin

    sys.modules[__name__] = pytest_plugin
