"""What the demo, the examples and the benchmarks check and run with (the test suites too): routing cases,
bitwise comparisons, multi-process runs. The test harnesses themselves (golden vectors included) live in
tests/harness."""
