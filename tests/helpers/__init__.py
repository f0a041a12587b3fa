"""Shared test helpers: builders, fakes and tool look-ups used by more than one test module.

Test modules import from here (or use the fixtures in conftest.py), never from each other.
"""
