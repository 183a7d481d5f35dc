"""hsgd.step."""
