"""What every layer stands on: errors, seeds, the block's settings, the process lock, the version,
the checked reading of plain (saved) data.

Imports only ``_errors`` and ``_torch`` of the package.  ``seed`` and
``settings`` import NumPy, ``settings`` reaches torch through ``_torch``
(a capability, the process's rank), and ``plain`` imports torch (saved
generator states are uint8 tensors); the errors, the lock and the version
import neither, so the command line reads the version without loading them.
"""
