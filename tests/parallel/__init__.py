"""Tests of ranks, DataLoader workers, torchrun, parallel streams, collectives."""
