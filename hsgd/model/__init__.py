"""hsgd.model."""
