"""Tests of the project's own tooling: the suite's leak guard (``tests/conftest.py``) and ``tools/``."""
