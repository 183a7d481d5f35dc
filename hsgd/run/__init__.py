"""hsgd.run."""
