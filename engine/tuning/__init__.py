"""Finding operating points: `tokenloom sweep` and the operating-point search."""
