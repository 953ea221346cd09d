"""Which GGML format each weight of a model gets: explicit rules and llama.cpp's mixes (``Q4_K_M`` and friends).

A weight is named relative to its decoder layer, as the pipeline sees it: ``self_attn.v_proj``,
``mlp.down_proj``, ``mlp.experts.down_proj`` (a fused experts stack), ``mlp.experts.gate_up_proj``. The format of a
weight is, in order: the first matching rule of the run (:func:`jgptq.plan.format_of`); else the rule of the preset
``PipelineConfig.mix``; else the default ``QuantConfig.format``.

Presets follow llama.cpp's ``llama_tensor_get_type_impl`` (``src/llama-quant.cpp``) for the weights of decoder
layers (the output head and embeddings are not the pipeline's: :func:`edge_format` gives their types, which the
GGUF exporter encodes), with ``n_layer`` the model's decoder layers,
``i`` the layer index and ``use_more_bits(i, n) = i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``:

==========  ======  ==========================================================================================
preset      base    raised tensors
==========  ======  ==========================================================================================
q4_k_m      q4_k    attn_v: q6_k where use_more_bits; ffn_down (dense, shared and experts): q6_k where
                    use_more_bits
q5_k_m      q5_k    attn_v and ffn_down: q6_k where use_more_bits
q4_k_s      q4_k    attn_v: q5_k in the first 4 layers; ffn_down: q5_k where i < n/8
q5_k_s      q5_k    (none)
q3_k_m      q3_k    attn_v: q5_k in the first 2 layers, else q4_k; ffn_down: q5_k where i < n/16, else q4_k;
                    attn_output: q4_k
q6_k        q6_k    (none)
q2_k_s      q2_k    attn_v: q4_k where n_gqa >= 4; ffn_down: q4_k where i < n/8
iq2_m       iq2_s   attn_v: q4_k where n_gqa >= 4 or n_expert >= 4, else iq3_s; ffn_down: iq3_s where i < n/8;
                    attn_output: iq3_s (q5_k with 8 experts); attn_k: q4_k with 8 experts
mxfp4_moe   mxfp4   routed experts (3-D tensors in GGUF) mxfp4, every other weight q8_0; no layer or 8-expert rule
==========  ======  ==========================================================================================

and, for models with exactly 8 experts per layer (llama.cpp's Mixtral rule), attn_v and attn_k become q8_0 and, in
q4_k_m, q4_k_s and q3_k_m, attn_output q5_k (q2_k_s takes the q8_0 attn_v and attn_k; iq2_m follows its own rules
above, where llama.cpp checks the IQ2/IQ1 mixes before the 8-expert rule). ``n_gqa`` is query heads per key-value
head (of the model's softmax attention). Categories: attn_v = ``v_proj``, attn_k = ``k_proj``, attn_output =
``o_proj``/``out_proj`` (not a linear attention's or short convolution's ``out_proj``: llama.cpp's
``ssm_out``/``shortconv.out_proj`` are plain weights), attn_qkv = ``qkv_proj``/``query_key_value``/``Wqkv`` and the
linear attention's ``in_proj_qkv`` (Qwen3.5) and ``in_proj_qkvz`` (Qwen3-Next), ffn_down = ``down_proj``/``w2`` (in
any MLP or experts module). llama.cpp gives attn_qkv attn_v's rules (its attn_v branch takes both) and counts both
in one attn_v counter, which equals the layer index for models with one attn_v or attn_qkv per layer (hybrids of
linear and softmax attention included), which is what is used here. Its ffn_down counter of the IQ2 mixes counts
ffn_down tensors in file order, a layer's dense one, then its experts', then its shared experts'
(:func:`ffn_down_order`). Qwen3-Next's ``in_proj_qkvz`` is one matrix of the plan, so one format (attn_qkv's rule),
and is written as ``attn_qkv`` and ``attn_gate``: where llama.cpp raises ``attn_qkv`` above the base type, its
``attn_gate`` keeps the base type and jgptq's has the raised one. Multi-head latent attention's ``kv_b_proj`` is no
attn_v: llama.cpp's files hold it split into ``attn_k_b``/``attn_v_b``, which its mixes treat as any other weight
(only a legacy unsplit ``attn_kv_b`` counts as attn_v there).

``mxfp4_moe`` is llama.cpp's MXFP4_MOE (gpt-oss's file type), which decides by tensor shape: a tensor with a third
dimension (a stack of routed experts) gets MXFP4, any other quantized one Q8_0, the token embedding and output head
included. Here an expert stack is a weight with an ``experts`` component in its name (``mlp.experts.down_proj``,
``block_sparse_moe.experts.3.w2``; not ``shared_experts``). llama.cpp also gives MXFP4 to the 3-D MLA projections
it splits ``kv_b_proj`` into (attn_k_b / attn_v_b); jgptq plans ``kv_b_proj`` as one matrix, so it gets q8_0.
"""

from __future__ import annotations

import re

PRESETS = {"q4_k_m": "q4_k", "q5_k_m": "q5_k", "q4_k_s": "q4_k", "q5_k_s": "q5_k", "q3_k_m": "q3_k",
           "q6_k": "q6_k", "q2_k_s": "q2_k", "iq2_m": "iq2_s", "mxfp4_moe": "mxfp4"}
# llama.cpp refuses to quantize these types without an importance matrix (``tensor_requires_imatrix``).
NEEDS_IMPORTANCE = ("iq3_xxs", "iq2_xxs", "iq2_xs", "iq2_s", "iq1_m", "iq1_s")
# llama.cpp's ``tensor_type_fallback``: a format for rows that are not a whole number of the wanted block.
LLAMA_FALLBACK = {"iq1_s": "iq4_nl", "iq1_m": "iq4_nl", "iq2_xxs": "iq4_nl", "iq2_xs": "iq4_nl",
                  "iq2_s": "iq4_nl", "iq3_xxs": "iq4_nl", "iq3_s": "iq4_nl", "iq4_xs": "iq4_nl", "q2_k": "q4_0",
                  "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}

_CATEGORIES = (
    # a linear-attention or short-convolution output (llama.cpp's ``ssm_out``, ``shortconv.out_proj``) is no attention
    # output: none of the mixes' rules names it
    ("other", re.compile(r"(^|\.)(linear_attn|conv)\.out_proj$")),
    ("attn_qkv", re.compile(r"(^|\.)(qkv_proj|query_key_value|Wqkv|in_proj_qkvz?)$")),
    ("attn_v", re.compile(r"(^|\.)v_proj$")),
    ("attn_k", re.compile(r"(^|\.)k_proj$")),
    ("attn_output", re.compile(r"(^|\.)(o_proj|out_proj)$")),
    ("ffn_down", re.compile(r"(^|\.)(down_proj|w2)$")),
)


_EXPERT_STACK = re.compile(r"(^|\.)experts(\.|$)")


def is_expert_stack(name: str) -> bool:
    """True for a routed-experts weight (a 3-D tensor in GGUF), named relative to its layer."""
    return bool(_EXPERT_STACK.search(name))


def category(name: str) -> str:
    """llama.cpp's tensor category of a weight named relative to its layer (``"other"`` if none applies)."""
    for cat, pattern in _CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's layer pattern for extra precision (first and last eighth, every third layer between)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def ffn_down_order(names) -> dict:
    """llama.cpp's counter of ffn_down tensors (its IQ2 mixes' ``i_ffn_down``) for weights given as (name relative to
    its layer, layer index) pairs: {(name, layer): the number of ffn_down tensors before it}. llama.cpp counts in
    file order (by layer, then by tensor name: ``ffn_down`` < ``ffn_down_exps`` < ``ffn_down_shexp``), one per
    GGUF tensor: the experts of a layer kept one module each count once."""
    def rank(name):
        return 1 if is_expert_stack(name) else 2 if "shared_expert" in name else 0
    tensors = sorted({(layer, rank(name)) for name, layer in names if category(name) == "ffn_down"})
    index = {t: i for i, t in enumerate(tensors)}
    return {(name, layer): index[(layer, rank(name))] for name, layer in names if category(name) == "ffn_down"}


def _iq2_m_format(cat: str, layer: int, n_layers: int, n_expert: int, n_gqa: int) -> str:
    """llama.cpp's IQ2_M rules (its branch for the IQ2/IQ1 mixes, taken before the 8-expert rule); ``layer`` is the
    ffn_down counter for an ffn_down weight."""
    if cat in ("attn_v", "attn_qkv"):
        return "q4_k" if n_gqa >= 4 or n_expert >= 4 else "iq3_s"
    if cat == "attn_k" and n_expert == 8:
        return "q4_k"
    if cat == "ffn_down" and layer < n_layers // 8:
        return "iq3_s"
    if cat == "attn_output":
        return "q5_k" if n_expert == 8 else "iq3_s"
    return "iq2_s"


def run_format(mix, fmt: str) -> str:
    """The ``quant.format`` of a run with mix preset ``mix`` (or None) and format ``fmt``: the preset's base format
    where ``fmt`` is left at ``"int"``, else ``fmt`` (a different GGML format is the config's error to raise)."""
    return PRESETS[mix] if mix is not None and fmt == "int" else fmt


def preset_format(preset: str, name: str, layer: int, n_layers: int, n_expert: int, n_gqa: int = 1,
                  down_index=None) -> str:
    """The format llama.cpp's mix ``preset`` gives the weight ``name`` of decoder layer ``layer`` of a model with
    ``n_expert`` experts per layer and ``n_gqa`` query heads per key-value head; ``down_index``: an ffn_down
    weight's place in llama.cpp's count of them (:func:`ffn_down_order`; None: its layer, as where a layer has one)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown mix preset {preset!r}; choose one of {sorted(PRESETS)}")
    base = PRESETS[preset]
    if preset == "mxfp4_moe":
        return base if is_expert_stack(name) else "q8_0"
    cat = category(name)
    more = use_more_bits(layer, n_layers)
    if preset == "iq2_m":
        counted = layer if down_index is None or cat != "ffn_down" else down_index
        return _iq2_m_format(cat, counted, n_layers, n_expert, n_gqa)
    if cat in ("attn_v", "attn_qkv"):
        out = base
        if preset == "q2_k_s" and n_gqa >= 4:
            out = "q4_k"
        if preset in ("q4_k_m", "q5_k_m") and more:
            out = "q6_k"
        elif preset == "q4_k_s" and layer < 4:
            out = "q5_k"
        elif preset == "q3_k_m":
            out = "q5_k" if layer < 2 else "q4_k"
        return "q8_0" if n_expert == 8 else out
    if cat == "attn_k":
        return "q8_0" if n_expert == 8 else base
    if cat == "ffn_down":
        if preset in ("q4_k_m", "q5_k_m") and more:
            return "q6_k"
        if preset == "q4_k_s" and layer < n_layers // 8:
            return "q5_k"
        if preset == "q3_k_m":
            return "q5_k" if layer < n_layers // 16 else "q4_k"
        if preset == "q2_k_s" and layer < n_layers // 8:
            return "q4_k"
        return base
    if cat == "attn_output":
        if n_expert == 8 and preset in ("q4_k_m", "q4_k_s", "q3_k_m"):
            return "q5_k"
        return "q4_k" if preset == "q3_k_m" else base
    return base


def possible_formats(config) -> set:
    """Every format a run under ``config`` may use (for checks made before any work)."""
    out = {config.quant.format} | {f for _, f in config.formats}
    if config.mix == "mxfp4_moe":
        out |= {"mxfp4", "q8_0"}
    elif config.mix is not None:
        out |= {PRESETS[config.mix], "q5_k", "q6_k", "q8_0", "q4_k"}
        if config.mix == "iq2_m":
            out |= {"iq3_s"}
    if config.block_fallback not in ("error", "llama.cpp"):
        out.add(config.block_fallback)
    return out


# llama.cpp's types for the token embedding (``token_embd``) and the output head (``output``), from the branches of
# ``llama_tensor_get_type_impl`` that name them. ``ftype`` is llama.cpp's file type of the run (a mix name, or the
# plain type of a format; q3_k/q4_k/q5_k alone are their _S mixes) and ``base`` its default GGML type.
_HEAD_Q5_K = ("iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq2_s", "iq2_m", "iq1_m")
_EMBD_Q2_K = ("iq2_xxs", "iq2_xs", "iq1_s", "iq1_m")
_EMBD_IQ3_S = ("iq2_s", "iq2_m", "iq3_xxs")
_PLAIN_FILE_TYPES = {"q3_k": "q3_k_s", "q4_k": "q4_k_s", "q5_k": "q5_k_s", "iq2_s": "iq2_m", "mxfp4": "mxfp4_moe"}


def file_type(mix, fmt: str) -> str:
    """llama.cpp's file type (lower case, without ``MOSTLY_``) of a run: its mix, else the plain type of ``fmt``
    (``q4_k`` -> ``q4_k_s``: llama.cpp has no plain Q4_K type; ``iq2_s`` -> ``iq2_m``, whose default type is
    IQ2_S; ``mxfp4`` -> ``mxfp4_moe``, the one file type whose default type is MXFP4)."""
    return mix if mix is not None else _PLAIN_FILE_TYPES.get(fmt, fmt)


def _fits(fmt: str, cols: int):
    """``fmt``, else llama.cpp's fallback chain (``tensor_type_fallback``) for rows of ``cols`` values; None where
    even the fallback does not fit (llama.cpp then writes F16)."""
    from jgptq.ggml import get_format

    if cols % get_format(fmt).block_size == 0:
        return fmt
    fallback = LLAMA_FALLBACK.get(fmt)
    return fallback if fallback is not None and cols % get_format(fallback).block_size == 0 else None


def edge_format(ftype: str, base: str, role: str, cols: int, tied: bool = False):
    """The GGML type llama.cpp's quantizer gives the token embedding or the output head under file type ``ftype``.

    Args:
      ftype: llama.cpp's file type of the run (:func:`file_type`), e.g. ``"q4_k_m"``, ``"q8_0"``, ``"iq2_xxs"``.
      base: its default GGML type (``"q4_k"`` for ``q4_k_m``).
      role: ``"token_embd"`` or ``"output"``.
      cols: the tensor's row length (the model's hidden size).
      tied: the model has no separate output head; the token embedding then gets the head's rule.
    Returns:
      A GGML format name, or None: llama.cpp keeps it in F16 (no block size fits the rows).
    """
    from jgptq.ggml import get_format

    if role not in ("token_embd", "output"):
        raise ValueError(f"role {role!r} is not 'token_embd' or 'output'")
    if ftype == "mxfp4_moe":  # llama.cpp's MXFP4_MOE branch comes first: both edges (2-D tensors) are Q8_0
        fmt = "q8_0"
    elif role == "output" or tied:
        if cols % get_format(base).block_size:
            fmt = "q8_0"
        elif ftype in _HEAD_Q5_K:
            fmt = "q5_k"
        else:
            fmt = base if base == "q8_0" else "q6_k"
    elif ftype in _EMBD_Q2_K:
        fmt = "q2_k"
    elif ftype in _EMBD_IQ3_S:
        fmt = "iq3_s"
    else:
        fmt = base
    return _fits(fmt, cols)
