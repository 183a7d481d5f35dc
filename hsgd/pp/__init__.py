"""hsgd.pp."""
