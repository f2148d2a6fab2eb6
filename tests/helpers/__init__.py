"""Helpers the tests share (imported as ``helpers.x``: tests/ is on sys.path through its conftest)."""
