"""Tests of assert_*, locate_divergence, fingerprints, traces, the audit."""
