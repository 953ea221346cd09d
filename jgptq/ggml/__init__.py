"""GGML (llama.cpp) block codecs as jitted JAX functions.

- :func:`encode` / :func:`decode`: validated entry points (float32 rows <-> uint8 payloads).
- :func:`get_format` returns a :class:`GGMLFormat` with its block geometry and its traceable ``encode``/``decode``
  functions (what solvers call inside ``jit``/``vmap``; they do no input checks).

Importing this package imports every codec module present, so each family registers itself.
"""

import importlib

from jgptq.ggml.registry import GGMLFormat, format_names, get_format, register

_CODEC_MODULES = ("legacy", "k_quants", "iq4", "iq2", "iq3", "iq1", "mxfp4")

for _name in _CODEC_MODULES:
    try:
        importlib.import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _err:  # a family not built yet; any other import error is real
        if _err.name != f"{__name__}.{_name}":
            raise

from jgptq.ggml.api import decode, encode  # noqa: E402

__all__ = ["GGMLFormat", "decode", "encode", "format_names", "get_format", "register"]
