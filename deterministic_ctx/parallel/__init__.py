"""Many processes and workers: ranks, per-rank seeds, ``seed_everything``, DataLoader
workers and named parallel RNG streams.
"""
