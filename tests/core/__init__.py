"""Tests of blocks, decorated callables, threads, fork, interrupts, torch.compile and CUDA graphs."""
