"""HunYuan MoE (``hunyuan_v1_moe``, transformers' ``HunYuanMoEV1ForCausalLM``): llama.cpp's ``hunyuan-moe``.

NeoX rotary embedding, then RMS norms of Q and K per head; in every layer a softmax top-k router over experts
(always renormalised) beside one shared MLP, the experts and the shared MLP both ``intermediate_size`` wide (what
transformers builds, whatever ``moe_intermediate_size`` says).

The released checkpoints scale the rotary base with a fixed NTK ``alpha`` (``rope_type "dynamic"`` with
``alpha``; transformers computes it once, as base x alpha^(d / (d - 2))): the file carries that base, as
llama.cpp's converter writes it. Dynamic scaling without ``alpha`` depends on the sequence length and is refused.
"""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, head_dim, refuse, rope_parameters


def _uniform(model, cfg, name: str) -> int:
    """The config's per-layer setting ``name`` (an int, or a list of equal ints) as one int."""
    value = getattr(cfg, name)
    values = set(value) if isinstance(value, (list, tuple)) else {value}
    if len(values) != 1:
        refuse(model, f"{name}={value}", "llama.cpp's hunyuan-moe takes one value for every layer")
    return int(values.pop())


def _alpha(cfg) -> float | None:
    rope = rope_parameters(cfg)
    return float(rope["alpha"]) if rope.get("rope_type") == "dynamic" and rope.get("alpha") else None


def _check(model, spec):
    cfg = model.config
    _uniform(model, cfg, "moe_topk")
    if not isinstance(cfg.num_experts, int):
        refuse(model, f"num_experts={cfg.num_experts}", "llama.cpp's hunyuan-moe has as many experts in every layer")
    if rope_parameters(cfg).get("rope_type") == "dynamic" and _alpha(cfg) is None:
        refuse(model, "rope_type 'dynamic' without alpha", "dynamic NTK scaling depends on the sequence length; "
               "llama.cpp's hunyuan-moe has a fixed rotary base")


def _meta(cfg, meta, key):
    k, r = gguf.Keys.LLM, gguf.Keys.Rope
    model = type("HunYuanMoEV1ForCausalLM", (), {"config": cfg})()
    meta[key(k.EXPERT_USED_COUNT)] = _uniform(model, cfg, "moe_topk")
    meta[key(k.EXPERT_SHARED_FEED_FORWARD_LENGTH)] = int(cfg.intermediate_size)
    meta[key(k.EXPERT_FEED_FORWARD_LENGTH)] = int(cfg.intermediate_size)
    meta[key(k.EXPERT_SHARED_COUNT)] = 1     # transformers builds one shared MLP
    alpha = _alpha(cfg)
    if alpha is not None:
        hd = head_dim(cfg)
        meta[key(r.FREQ_BASE)] = float(rope_parameters(cfg).get("rope_theta", 10000.0)) * alpha ** (hd / (hd - 2))
        meta[key(r.SCALING_TYPE)] = gguf.RopeScalingType.NONE.value
        meta[key(r.SCALING_FACTOR)] = 1.0


FAMILIES = [Arch("hunyuan_v1_moe", gguf.MODEL_ARCH.HUNYUAN_MOE, permute_qk=False, check=_check,
                 meta=_meta, rope_types=("dynamic",))]
