"""Multi-process harnesses of the test suites (importable by the children that run_ranks spawns)."""
