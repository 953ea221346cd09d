"""Llama and Mixtral: llama.cpp's ``llama`` architecture (normal RoPE, so Q/K rows are permuted)."""

import gguf

from jgptq_torch.export.gguf.families.base import Arch

FAMILIES = [
    Arch("llama", gguf.MODEL_ARCH.LLAMA, permute_qk=True),
    Arch("mixtral", gguf.MODEL_ARCH.LLAMA, permute_qk=True, norm_topk=True, norm_topk_default=True),
]
