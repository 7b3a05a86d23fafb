"""Data sets for the bundled jobs."""
