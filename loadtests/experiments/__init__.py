"""One-off investigations kept runnable (`python -m loadtests.experiments.NAME`), not benchmarks."""
