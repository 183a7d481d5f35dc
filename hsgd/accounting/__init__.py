"""hsgd.accounting."""
