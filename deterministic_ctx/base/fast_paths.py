"""The fast paths' off switch, and how a source declares a fast path.

``DETERMINISTIC_CTX_NO_FAST_PATHS=1`` in the environment when this module is
first imported turns every fast path off (:data:`ENABLED` is then
``False``): no raw-memory layout is probed or used, no cache remembers
anything, ``os.environ`` is read and written through its public API,
registered RNGs take their public API one by one.  Each path is chosen once,
at import (or at registration, for a registered RNG), so the same suite
proves both ways: CI runs it once with the variable set.

Each source (and each kind of RNG, :mod:`deterministic_ctx.sources.rngs`)
declares its own paths as :class:`FastPath` values; ``fast_paths()``
(``report()`` shows it) lists every one, with whether this process takes it.

Example:
    >>> from deterministic_ctx.base.fast_paths import ENABLED, FastPath
    >>> path = FastPath("an example: nothing", lambda: ENABLED)
    >>> path.used() is ENABLED
    True
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["ENABLED", "SWITCH", "FastPath"]

#: The environment variable that turns every fast path off (read once, at import).
SWITCH = "DETERMINISTIC_CTX_NO_FAST_PATHS"
#: Whether fast paths may be used: ``False`` where :data:`SWITCH` is set to
#: anything but ``""`` or ``"0"``.
ENABLED: bool = os.environ.get(SWITCH, "") in ("", "0")


class FastPath(NamedTuple):
    """One fast path: ``what`` it speeds up, and ``used()``, whether this
    process takes it (never with :data:`ENABLED` false; a path over raw
    memory only where its layout was proven).  ``used`` is a function, not a
    flag, so that a layout probed at first use is probed only when asked."""

    what: str
    used: Callable[[], bool]
