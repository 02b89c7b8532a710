"""Helpers shared by the tests, the demo and the benchmarks: routing cases and multi-process runs."""
