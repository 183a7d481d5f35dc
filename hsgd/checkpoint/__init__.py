"""hsgd.checkpoint."""
