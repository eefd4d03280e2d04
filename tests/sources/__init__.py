"""Tests of torch's capabilities, each source of global state, the fused plan, registered RNGs."""
