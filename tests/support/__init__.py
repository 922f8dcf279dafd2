"""What the tests share: builders, fakes, hypothesis strategies, launchers and waits (no tests here)."""
