"""Tests of the CLI, IPython, the pytest plugin, pytest-randomly, Hypothesis, real libraries."""
