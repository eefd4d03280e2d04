"""Blocks: the world (every source captured at once), the engine (enter, leave, suspend,
resume), ``deterministic`` / ``isolated``, ``@reproducible`` and ``allow_nondeterministic``.

Imports neither torch nor NumPy: the sources below do that work.  Where blocks
meet ``torch.compile`` and the dispatcher, they go through ``_torch``.
"""
