"""Random state outside a block: snapshots, their file format, ``torch.distributed.checkpoint``
and sending one rank's state to every rank.
"""
