"""What every layer stands on: errors, seeds, the block's settings, the process lock, the version.

Imports nothing else of the package (and neither torch nor NumPy).
"""
