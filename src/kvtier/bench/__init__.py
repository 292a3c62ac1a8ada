"""Benchmarks behind ``kvtier bench``: every figure is a ratio to a limit measured in the same run."""
