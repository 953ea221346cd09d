"""Llama 4 text models (``llama4_text``, transformers' ``Llama4ForCausalLM``): llama.cpp's ``llama4``.

Rotary embedding on interleaved pairs (transformers' complex rotation is llama.cpp's normal RoPE: no permutation);
routed experts scored by a sigmoid of their top-k logits, each token multiplied by its score before the expert
(llama.cpp does the same for this architecture alone), plus a shared expert as wide as the routed ones; a MoE
layer every ``interleave_moe_layer_step`` layers, dense MLPs of ``intermediate_size_mlp`` between.

llama.cpp hard-codes the attention pattern: every fourth layer (``(i + 1) % 4 == 0``) attends to the whole
context without rotary embedding and with the temperature tuning of its queries (floor scale 8192, scale 0.1);
the other layers rotate and attend within chunks of 8192 tokens; Q/K are RMS-normalised (no weight) on the rotated
layers unless the model has 128 experts. A config whose layers, chunk size, temperature or Q/K norm say otherwise
is refused.
"""

import gguf

from jgptq_torch.export.gguf.families.base import Arch, num_experts, refuse

PERIOD = 4          # llama.cpp's no-rope layer step and chunked-attention pattern (3 chunked, 1 full)
CHUNK = 8192        # llama.cpp's chunk size of the chunked layers
FLOOR_SCALE, ATTN_SCALE = 8192, 0.1   # llama.cpp's temperature tuning of the no-rope layers


def _check(model, spec):
    cfg = model.config
    layers = int(cfg.num_hidden_layers)
    rotated = [int((i + 1) % PERIOD != 0) for i in range(layers)]
    if [int(bool(x)) for x in cfg.no_rope_layers[:layers]] != rotated:
        refuse(model, f"no_rope_layers {list(cfg.no_rope_layers[:layers])}",
               f"llama.cpp's llama4 skips the rotary embedding on every {PERIOD}th layer only")
    chunked = ["chunked_attention" if r else "full_attention" for r in rotated]
    if list(cfg.layer_types) != chunked:
        refuse(model, f"layer_types {list(cfg.layer_types)}",
               "llama.cpp's llama4 attends in chunks on the rotated layers and to the whole context on the others")
    if int(cfg.attention_chunk_size or 0) != CHUNK:
        refuse(model, f"attention_chunk_size={cfg.attention_chunk_size}", f"llama.cpp's llama4 uses chunks of {CHUNK}")
    if not cfg.attn_temperature_tuning or (int(cfg.floor_scale), float(cfg.attn_scale)) != (FLOOR_SCALE, ATTN_SCALE):
        refuse(model, f"attn_temperature_tuning={cfg.attn_temperature_tuning}, floor_scale={cfg.floor_scale}, "
               f"attn_scale={cfg.attn_scale}", f"llama.cpp's llama4 always tunes the no-rope layers' query temperature "
               f"with floor_scale {FLOOR_SCALE} and attn_scale {ATTN_SCALE}")
    if bool(cfg.use_qk_norm) != (num_experts(cfg) != 128):
        refuse(model, f"use_qk_norm={cfg.use_qk_norm}", "llama.cpp's llama4 normalises Q/K exactly when the model "
               "does not have 128 experts")
    step = int(cfg.interleave_moe_layer_step)
    every = [i for i in range(layers) if step > 0 and (i + 1) % step == 0]
    if sorted(cfg.moe_layers) != every:
        refuse(model, f"moe_layers {list(cfg.moe_layers)}", f"llama.cpp's llama4 has experts in every "
               f"interleave_moe_layer_step={step}th layer: {every}")


def _meta(cfg, meta, key):
    k = gguf.Keys.LLM
    meta[key(k.FEED_FORWARD_LENGTH)] = int(cfg.intermediate_size_mlp)
    meta[key(k.INTERLEAVE_MOE_LAYER_STEP)] = int(cfg.interleave_moe_layer_step)


FAMILIES = [Arch("llama4_text", gguf.MODEL_ARCH.LLAMA4, permute_qk=False, expert_ff="intermediate_size",
                 check=_check, meta=_meta)]
