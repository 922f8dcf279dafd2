"""The benchmarks, a package: run each from the repository root as `python -m bench.<name>` (`make bench` runs them all)."""
