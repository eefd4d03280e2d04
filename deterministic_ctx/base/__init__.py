"""What every layer stands on: errors, seeds, the block's settings, the process lock,
the scope stack, the completion step, the version.

Imports only ``_errors`` and ``_torch`` of the package.  ``seed`` and
``settings`` import NumPy, and ``settings`` reaches torch through ``_torch``
(a capability, the process's rank); the errors, the lock, the scope stack,
the completion step and the version import neither, so the command line
reads the version without loading them.
"""
