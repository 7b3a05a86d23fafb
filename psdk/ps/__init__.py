"""The ps task."""
