"""Other tools' entry points into the library: the command line, the IPython magic,
Hypothesis, pytest-randomly and the pytest plugin.  They use the public API and
:mod:`deterministic_ctx.internal` only.
"""
