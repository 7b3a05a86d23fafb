"""Backends that ship with psdk's core (the numpy reference)."""
