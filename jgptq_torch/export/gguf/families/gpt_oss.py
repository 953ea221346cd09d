"""gpt-oss (``gpt_oss``): llama.cpp's ``gpt-oss``.

NeoX rotary embedding (no permutation) with YaRN scaling; Q/K/V and output biases; a per-head attention sink
(``attn_sinks``, a logit that joins each softmax and is then dropped); layers alternating sliding-window (even
layers) and full attention, which llama.cpp assumes (it reads only the window); a softmax over the top-k router
logits (the router has a bias); experts with biases whose fused ``gate_up_proj`` interleaves gate and up columns,
split into ``ffn_gate_exps``/``ffn_up_exps`` (weights and biases alike), and the clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, whose ``alpha``/``limit``
llama.cpp hard-codes (1.702 and 7.0).

YaRN: llama.cpp's graph reads the factor and the original context; it takes the beta bounds and the attention
factor from its own defaults (32, 1 and ``1 + 0.1 ln(factor)``), so other values are refused. It rounds the
correction range to whole dimensions (floor, ceil), as transformers does with ``truncate=True``; gpt-oss's
releases say ``truncate=False``, which llama.cpp (and its converter's file) cannot express: such a model is
exported with a warning, and llama.cpp runs it with the rounded range (a slightly different rotation of the
dimensions inside the ramp).
"""

import warnings

import gguf

from jgptq_torch.export.gguf.families.base import Arch, Target, refuse, rope_parameters

# llama.cpp's constants of its clamped SwiGLU (LLM_FFN_SWIGLU_OAI_MOE)
ALPHA, LIMIT = 1.702, 7.0
# llama.cpp's defaults for what its gpt-oss loader does not read
_YARN_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}
_YARN_UNREAD = ("attention_factor", "attn_factor", "mscale", "mscale_all_dim", "extrapolation_factor")


def _check(model, spec):
    cfg = model.config
    alpha, limit = float(getattr(cfg, "swiglu_alpha", ALPHA)), float(getattr(cfg, "swiglu_limit", LIMIT))
    if (alpha, limit) != (ALPHA, LIMIT):
        refuse(model, f"swiglu_alpha={alpha}, swiglu_limit={limit}",
               f"llama.cpp's {spec.name} hard-codes alpha {ALPHA} and limit {LIMIT}")
    layers = int(cfg.num_hidden_layers)
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if list(getattr(cfg, "layer_types", None) or []) != alternating or not getattr(cfg, "sliding_window", None):
        refuse(model, f"layer_types {getattr(cfg, 'layer_types', None)}, sliding_window "
               f"{getattr(cfg, 'sliding_window', None)}", f"llama.cpp's {spec.name} alternates sliding-window "
               f"(even) and full (odd) layers and needs the window")
    rope = rope_parameters(cfg)
    if rope.get("rope_type") != "yarn":
        return
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        refuse(model, "rope_type 'yarn' without factor or original_max_position_embeddings",
               "llama.cpp reads both from the file")
    for name, default in _YARN_BETAS.items():
        if rope.get(name) is not None and float(rope[name]) != default:
            refuse(model, f"rope {name}={rope[name]}", f"llama.cpp's {spec.name} uses {default}")
    for name in _YARN_UNREAD:
        if rope.get(name) is not None:
            refuse(model, f"rope {name}={rope[name]}", f"llama.cpp's {spec.name} does not read it")
    if not rope.get("truncate", True):
        warnings.warn(f"{type(model).__name__}: rope truncate=False: llama.cpp rounds YaRN's correction range to "
                      f"whole dimensions (transformers' truncate=True); its rotation differs slightly inside the "
                      f"ramp", stacklevel=2)


def _meta(cfg, meta, key):
    meta[key(gguf.Keys.Attention.SLIDING_WINDOW)] = int(cfg.sliding_window)


def _special(model, spec, param, tmap):
    """The sinks (``attn_sinks.weight``, float32) and the output projection's and router's biases."""
    owner, _, attr = param.rpartition(".")
    if attr == "sinks":
        return [Target(tmap.get_name(param) + ".weight", role="norm")]
    if param.endswith((".self_attn.o_proj.bias", ".mlp.router.bias")):
        return [Target(tmap.get_name(owner) + ".bias", role="bias")]
    return None


FAMILIES = [Arch("gpt_oss", gguf.MODEL_ARCH.GPT_OSS, permute_qk=False, output_required=True,
                 expert_ff="intermediate_size", qkv_bias=True, expert_bias=True, window_from_layer_types=True,
                 rope_types=("yarn",), check=_check, meta=_meta, special=_special)]
