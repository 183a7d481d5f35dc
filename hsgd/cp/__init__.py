"""hsgd.cp."""
