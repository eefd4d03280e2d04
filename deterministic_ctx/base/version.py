"""The version of deterministic-ctx (one place; the package and the reports read it)."""

__version__ = "0.1.0"
