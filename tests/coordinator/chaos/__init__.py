"""Faults injected for real into the engines under a Coordinator (SIGKILL, hangs, resets): the
chaos tier (tests/conftest.py)."""
