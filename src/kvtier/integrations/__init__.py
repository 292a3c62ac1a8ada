"""Bridges from model runtimes to kvtier."""
