"""One entry per transformers family the GGUF exporter writes: :data:`ARCHITECTURES` (``model_type`` ->
:class:`Arch`). Each module declares its families' llama.cpp architecture, refusals, metadata and any tensors the
``gguf`` package's name map does not give by itself."""

from jgptq_torch.export.gguf.families import (afmoe, deepseek, ernie, glm, gpt_oss, granite, hunyuan, lfm2, llama,
                                              llama4, olmoe, qwen, qwen3next, qwen35, sigmoid_routed)
from jgptq_torch.export.gguf.families.base import Arch, UnsupportedGGUFModel

_MODULES = (llama, qwen, olmoe, deepseek, glm, sigmoid_routed, granite, ernie, gpt_oss, llama4, hunyuan, lfm2, afmoe,
            qwen3next, qwen35)
ARCHITECTURES = {spec.model_type: spec for module in _MODULES for spec in module.FAMILIES}

# model_type -> why llama.cpp's architecture for it would compute another function (refused with that reason)
REFUSED = {
    "phimoe": "llama.cpp's phimoe routes with a renormalised softmax top-2, not transformers' sparsemixer, and "
              "loads an output bias the model need not have",
}

__all__ = ["ARCHITECTURES", "REFUSED", "Arch", "UnsupportedGGUFModel"]
