"""One module per group of transformers families the GGUF exporter writes; each declares its families' llama.cpp
architecture (``FAMILIES``: :class:`Arch` entries), refusals, metadata and any tensors the ``gguf`` package's name
map does not give by itself. The table of them, ``model_type`` -> :class:`Arch`, is
:data:`jgptq_torch.export.gguf.arch.ARCHITECTURES`."""

from jgptq_torch.export.gguf.families.base import Arch, UnsupportedGGUFModel

__all__ = ["Arch", "UnsupportedGGUFModel"]
