"""GLM-4.5 / GLM-4.6 (``glm4_moe``): llama.cpp's ``glm4moe``. Partial NeoX rotary embedding (the first
``partial_rotary_factor`` of each head), Q/K/V biases, optional Q/K norms, and DeepSeek-V3's routing (sigmoid
scores, correction bias, groups, scaling) with dense leading layers and shared experts."""

import gguf

from jgptq_torch.export.gguf.families.base import (Arch, check_groups, correction_bias, head_dim, rope_parameters,
                                                   sigmoid_routing)


def _meta(cfg, meta, key):
    partial = float(rope_parameters(cfg).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    meta[key(gguf.Keys.Rope.DIMENSION_COUNT)] = int(head_dim(cfg) * partial)
    sigmoid_routing(cfg, meta, key, always_norm=True)


FAMILIES = [Arch("glm4_moe", gguf.MODEL_ARCH.GLM4_MOE, permute_qk=False, expert_ff="moe_intermediate_size",
                 qkv_bias=True, check=check_groups, meta=_meta, special=correction_bias)]
