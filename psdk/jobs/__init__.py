"""Jobs psdk can run from its CLI."""
