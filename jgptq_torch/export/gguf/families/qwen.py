"""Qwen2-MoE and Qwen3-MoE: llama.cpp's ``qwen2moe`` (shared expert with a sigmoid gate, Q/K/V biases, no top-k
renormalisation) and ``qwen3moe`` (Q/K norms, renormalised top-k)."""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, require_every_layer_moe, require_mha_width


def _qwen2_moe(model, spec):
    require_mha_width(model, spec)
    require_every_layer_moe(model, spec)


FAMILIES = [
    Arch("qwen3_moe", gguf.MODEL_ARCH.QWEN3MOE, permute_qk=False, norm_topk=True,
         expert_ff="moe_intermediate_size", check=require_every_layer_moe),
    Arch("qwen2_moe", gguf.MODEL_ARCH.QWEN2MOE, permute_qk=False, output_required=True, norm_topk=False,
         expert_ff="moe_intermediate_size", shared_ff="shared_expert_intermediate_size", qkv_bias=True,
         check=_qwen2_moe),
]
