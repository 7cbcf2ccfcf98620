"""Helpers for tests and benchmarks: multi-process harnesses and measurement of the model's work.

Nothing in the library imports this package; the model runs without it.
"""
