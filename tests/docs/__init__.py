"""Tests of every code block of the README and the docs, and the examples."""
