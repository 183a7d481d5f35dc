"""hsgd.grid."""
