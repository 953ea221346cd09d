"""The version of jgptq (a leaf module: it imports nothing, so any module may read it)."""

__version__ = "0.1.0"
