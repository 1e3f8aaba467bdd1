"""Engines that hang for real under a NodeManager (a stopped process group, a wedged scheduler):
the chaos tier (tests/conftest.py)."""
