"""Tests of report()."""
