"""hsgd.check."""
