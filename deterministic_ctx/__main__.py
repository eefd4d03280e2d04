"""``python -m deterministic_ctx``: the command line.

See :mod:`deterministic_ctx.integrations.cli`.
"""

from __future__ import annotations

from .integrations.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
