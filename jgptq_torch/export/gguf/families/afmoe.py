"""AFMoE (``afmoe``, Arcee's Trinity models, transformers' ``AfmoeForCausalLM``): llama.cpp's ``afmoe``.

Embeddings scaled by sqrt(hidden) (muP); attention with per-head Q/K norms, a sigmoid output gate (``gate_proj``,
applied before ``o_proj``) and RMS norms before and after both the attention and the feed-forward block; dense
leading layers, then sigmoid-scored experts chosen with a correction bias (``exp_probs_b``), renormalised and
scaled by ``route_scale``, beside ``num_shared_experts`` shared experts fused into one MLP.

llama.cpp hard-codes the attention pattern: of every four layers the first three attend within the sliding window
with the NeoX rotary embedding, the fourth to the whole context without it. transformers rotates exactly the
sliding layers, so a config whose ``layer_types`` follow that pattern computes the same function; others are
refused, as are configs without muP scaling (llama.cpp always applies it).
"""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, Target, refuse

PERIOD = 4   # llama.cpp's pattern: 3 sliding layers with rotary embedding, then 1 global layer without


def _check(model, spec):
    cfg = model.config
    layers = int(cfg.num_hidden_layers)
    pattern = ["sliding_attention" if i % PERIOD < PERIOD - 1 else "full_attention" for i in range(layers)]
    if list(cfg.layer_types) != pattern:
        refuse(model, f"layer_types {list(cfg.layer_types)}", f"llama.cpp's afmoe makes every {PERIOD}th layer "
               f"global (and without rotary embedding), the others sliding")
    if "sliding_attention" in pattern and not cfg.sliding_window:
        refuse(model, f"sliding_window={cfg.sliding_window}", "llama.cpp's afmoe needs the sliding layers' window")
    if not cfg.mup_enabled:
        refuse(model, "mup_enabled=False", "llama.cpp's afmoe always scales the embeddings by sqrt(hidden_size)")
    if not cfg.num_shared_experts:
        refuse(model, "num_shared_experts=0", "transformers then builds an empty shared MLP, which has no tensor")


def _meta(cfg, meta, key):
    k = gguf.Keys.LLM
    meta[key(k.EXPERT_SHARED_COUNT)] = int(cfg.num_shared_experts)
    meta[key(k.LEADING_DENSE_BLOCK_COUNT)] = int(cfg.num_dense_layers or 0)
    meta[key(k.EXPERT_WEIGHTS_NORM)] = True   # transformers' router always renormalises (whatever route_norm says)
    meta[key(k.EXPERT_WEIGHTS_SCALE)] = float(cfg.route_scale)
    if cfg.sliding_window:
        meta[key(gguf.Keys.Attention.SLIDING_WINDOW)] = int(cfg.sliding_window)


def _special(model, spec, param, tmap):
    if param.endswith(".mlp.expert_bias"):
        return [Target(tmap.get_name(param) + ".bias", role="norm")]
    return None


FAMILIES = [Arch("afmoe", gguf.MODEL_ARCH.AFMOE, permute_qk=False, expert_ff="moe_intermediate_size",
                 window_from_layer_types=True, check=_check, meta=_meta, special=_special)]
