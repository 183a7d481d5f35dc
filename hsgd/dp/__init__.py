"""hsgd.dp."""
