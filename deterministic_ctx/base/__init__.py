"""What every layer stands on: errors, seeds, the block's settings, the process lock, the
scope stack (which blocks are open, where), the completion step, calls made with the garbage
collector held off, the version, the checked reading of plain (saved) data, the fast paths'
switch and the one bounded cache.

Imports only ``_errors`` and ``_torch`` of the package.  ``seed`` and
``settings`` import NumPy, ``settings`` reaches torch through ``_torch``
(a capability, the process's rank), and ``plain`` imports torch (saved
generator states are uint8 tensors); the errors, the lock, the scope stack,
the completion step, the collector (``collector``), the version, the fast
paths' switch (``fast_paths``) and
the bounded cache (``cache``) import neither, so the command line reads the
version without loading them.
"""
