"""kvcompose's benchmarks: ``make bench`` (``python -m benchmarks``) runs them all side by side."""
