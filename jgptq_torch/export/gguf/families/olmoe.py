"""OLMoE: llama.cpp's ``olmoe`` (Q/K norms over the whole projection, no top-k renormalisation)."""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, refuse, require_mha_width


def _check(model, spec):
    cfg = model.config
    require_mha_width(model, spec)
    if getattr(cfg, "clip_qkv", None) is not None:
        refuse(model, "clip_qkv", "llama.cpp's olmoe graph does not clip Q/K/V")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        refuse(model, "num_key_value_heads != num_attention_heads",
               "llama.cpp's olmoe loads attn_k_norm with the full embedding width (multi-head attention only)")


FAMILIES = [Arch("olmoe", gguf.MODEL_ARCH.OLMOE, permute_qk=False, output_required=True, norm_topk=False,
                 check=_check)]
