"""Blocks: the world (every source captured at once), the engine (enter, leave, suspend,
resume), ``deterministic`` / ``isolated`` and ``@reproducible``.

Knows nothing of torch or NumPy: the sources below do that work.
"""
