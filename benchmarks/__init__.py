"""The jgptq benchmark harness: ``python -m benchmarks <name>`` (see benchmarks/__main__.py)."""
