"""``python -m psdk bench``: psdk against the parameter servers users would pick instead."""
