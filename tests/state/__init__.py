"""Tests of snapshots, their file format, checkpoints, DCP and rank-to-rank sync."""
