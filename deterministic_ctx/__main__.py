"""``python -m deterministic_ctx``: the command line (see :mod:`deterministic_ctx.cli`)."""

from __future__ import annotations

from .integrations.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
