"""hsgd.tp."""
