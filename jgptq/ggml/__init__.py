"""GGML (llama.cpp) block codecs as jitted JAX functions.

``get_format(name)`` returns a :class:`GGMLFormat` with its block geometry and its ``encode``/``decode``
functions. Codec modules of each family register themselves when this package is imported.
"""

from jgptq.ggml.registry import GGMLFormat, format_names, get_format, register

__all__ = ["GGMLFormat", "format_names", "get_format", "register"]
