"""What llama.cpp needs to know about a transformers model: its GGUF architecture, metadata and tensor names.

- :data:`ARCHITECTURES`: the transformers ``model_type``\\ s the GGUF exporter writes and their llama.cpp
  architecture, one entry per family in :mod:`jgptq_torch.export.gguf.families` (names and metadata keys come
  from the ``gguf`` package's tables).
- :func:`arch_of`: the :class:`Arch` of a model, after checking that llama.cpp computes the same function.
- :func:`gguf_names`: model parameter name -> the GGUF tensors its rows go to.
- :func:`metadata`: the ``{arch}.*`` hyperparameter keys from the model's config.
- :func:`qk_row_order`: the row order of the HF -> llama.cpp rotary permutation of Q and K.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from jgptq_torch import models
from jgptq_torch.export.gguf.families import (afmoe, deepseek, ernie, glm, gpt_oss, granite, hunyuan, lfm2, llama,
                                              llama4, olmoe, qwen, qwen3next, qwen35, sigmoid_routed)
from jgptq_torch.export.gguf.families.base import Arch, Target, UnsupportedGGUFModel, head_dim, num_experts
from jgptq_torch.export.gguf.families.base import refuse as _refuse, rope_parameters as _rope

_FAMILY_MODULES = (llama, qwen, olmoe, deepseek, glm, sigmoid_routed, granite, ernie, gpt_oss, llama4, hunyuan, lfm2,
                   afmoe, qwen3next, qwen35)
ARCHITECTURES = {spec.model_type: spec for module in _FAMILY_MODULES for spec in module.FAMILIES}

# model_type -> why llama.cpp's architecture for it would compute another function (refused with that reason)
REFUSED = {
    "phimoe": "llama.cpp's phimoe routes with a renormalised softmax top-2, not transformers' sparsemixer, and "
              "loads an output bias the model need not have",
}


def arch_of(model) -> Arch:
    """The :class:`Arch` of ``model``, after refusing settings llama.cpp's graph for the family does not compute.

    Raises:
      UnsupportedGGUFModel: an unsupported ``model_type`` (the message lists the supported ones), or a setting
        (biases, routing normalisation, dense layers in a MoE family, rope scaling, ...) that llama.cpp would
        silently compute differently.
    """
    return arch_of_config(model.config, type(model).__name__)


def arch_of_config(cfg, name: str) -> Arch:
    """:func:`arch_of` from a transformers config alone (``name``: the model class named in messages), so that a
    model llama.cpp cannot run faithfully is refused before its weights are loaded."""
    model = type(name, (), {"config": cfg})()   # named in the messages as the model class would be
    mt = getattr(cfg, "model_type", None)
    if mt in REFUSED:
        raise UnsupportedGGUFModel(f"{type(model).__name__} (model_type {mt!r}): {REFUSED[mt]}")
    if mt not in ARCHITECTURES:
        raise UnsupportedGGUFModel(f"{type(model).__name__} (model_type {mt!r}) has no GGUF exporter; supported "
                                   f"model types: {sorted(ARCHITECTURES)}")
    spec = ARCHITECTURES[mt]
    if getattr(cfg, "attention_bias", False) and not spec.qkv_bias:
        _refuse(model, "attention_bias=True", "attention biases are not written by this exporter")
    if getattr(cfg, "mlp_bias", False):
        _refuse(model, "mlp_bias=True", "MLP biases are not written by this exporter")
    if spec.norm_topk is not None:
        given = bool(getattr(cfg, "norm_topk_prob", spec.norm_topk_default))
        if given != spec.norm_topk:
            _refuse(model, f"norm_topk_prob={given}", f"llama.cpp's {spec.name} graph always uses "
                    f"norm_topk_prob={spec.norm_topk}; the GGUF would route differently. A model trained with "
                    f"norm_topk_prob={given} runs faithfully from a compressed-tensors or gptq checkpoint (transformers "
                    f"and vLLM read the setting); if its config.json is wrong, set norm_topk_prob to "
                    f"{str(spec.norm_topk).lower()} there")
    if spec.check is not None:
        spec.check(model, spec)
    if not spec.window_from_layer_types and (getattr(cfg, "use_sliding_window", False)
                                             or getattr(cfg, "sliding_window", None)):
        _refuse(model, f"sliding_window={getattr(cfg, 'sliding_window', None)}",
                f"llama.cpp's {spec.name} graph attends to the whole context")
    rope = _rope(cfg)
    kind = rope.get("rope_type", "default")
    known = ("default", "linear", "llama3") + tuple(spec.rope_types)
    if kind not in known:
        _refuse(model, f"rope_type {kind!r}", f"supported rope types of {spec.name} are "
                + ", ".join(repr(k) for k in known))
    if kind == "llama3" and spec.arch not in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.LLAMA4):
        _refuse(model, "rope_type 'llama3'", f"only llama.cpp's llama and llama4 read rope_freqs, not {spec.name}")
    return spec


def metadata(model, spec: Arch) -> dict:
    """The ``{arch}.*`` hyperparameter keys of ``model`` (ordered as llama.cpp's converter writes them)."""
    cfg = model.config
    k = gguf.Keys.LLM
    a = gguf.Keys.Attention
    r = gguf.Keys.Rope
    name = spec.name

    def key(template):
        return template.format(arch=name)

    hd = head_dim(cfg)
    meta = {
        key(k.VOCAB_SIZE): int(cfg.vocab_size),
        key(k.CONTEXT_LENGTH): int(cfg.max_position_embeddings),
        key(k.EMBEDDING_LENGTH): int(cfg.hidden_size),
        key(k.BLOCK_COUNT): int(cfg.num_hidden_layers),
    }
    if getattr(cfg, "intermediate_size", None) is not None:   # families with experts in every layer may have none
        meta[key(k.FEED_FORWARD_LENGTH)] = int(cfg.intermediate_size)
    meta |= {
        key(a.HEAD_COUNT): int(cfg.num_attention_heads),
        key(a.HEAD_COUNT_KV): int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        key(a.KEY_LENGTH): hd,
        key(a.VALUE_LENGTH): hd,
        key(a.LAYERNORM_RMS_EPS): float(cfg.rms_norm_eps if hasattr(cfg, "rms_norm_eps") else cfg.norm_eps),
    }
    rope = _rope(cfg)
    meta[key(r.FREQ_BASE)] = float(rope.get("rope_theta", 10000.0))
    meta[key(r.DIMENSION_COUNT)] = hd
    if rope.get("rope_type") == "linear":
        meta[key(r.SCALING_TYPE)] = gguf.RopeScalingType.LINEAR.value
        meta[key(r.SCALING_FACTOR)] = float(rope["factor"])
    elif rope.get("rope_type") == "yarn":  # only for families listing it in rope_types (their checks refuse the rest)
        meta[key(r.SCALING_TYPE)] = gguf.RopeScalingType.YARN.value
        meta[key(r.SCALING_FACTOR)] = float(rope["factor"])
        meta[key(r.SCALING_ORIG_CTX_LEN)] = int(rope["original_max_position_embeddings"])
        for beta, template in (("beta_fast", r.SCALING_YARN_BETA_FAST), ("beta_slow", r.SCALING_YARN_BETA_SLOW)):
            if rope.get(beta) is not None:
                meta[key(template)] = float(rope[beta])
    experts = num_experts(cfg)
    if experts:
        meta[key(k.EXPERT_COUNT)] = experts
        used = cfg.num_experts_per_tok   # a per-layer list in some configs (the family's meta says how to write it)
        meta[key(k.EXPERT_USED_COUNT)] = int(max(used) if isinstance(used, (list, tuple)) else used)
        if spec.expert_ff:
            meta[key(k.EXPERT_FEED_FORWARD_LENGTH)] = int(getattr(cfg, spec.expert_ff))
        if spec.shared_ff:
            meta[key(k.EXPERT_SHARED_FEED_FORWARD_LENGTH)] = int(getattr(cfg, spec.shared_ff))
    if spec.meta is not None:
        spec.meta(cfg, meta, key)
    return meta


def rope_freqs(cfg) -> np.ndarray | None:
    """float32 (head_dim / 2,): llama3 rope scaling factors (llama.cpp's ``rope_freqs`` tensor), or None.

    Each step is rounded to float32, as transformers computes the frequencies and llama.cpp's converter the factors.
    """
    rope = _rope(cfg)
    if rope.get("rope_type") != "llama3":
        return None
    f32 = np.float32
    base, dim = float(rope.get("rope_theta", 10000.0)), head_dim(cfg)
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old = float(rope.get("original_max_position_embeddings", 8192))
    freqs = f32(1.0) / (f32(base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)))
    out = []
    for f in freqs:
        wavelen = f32(2 * math.pi) / f
        if wavelen < old / high:
            out.append(f32(1.0))
        elif wavelen > old / low:
            out.append(f32(factor))
        else:
            smooth = (f32(old) / wavelen - f32(low)) / f32(high - low)
            out.append(f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth))
    return np.asarray(out, np.float32)


def qk_row_order(n_head: int, rows: int) -> np.ndarray:
    """int (rows,): llama.cpp row ``i`` of a permuted Q/K projection is HF row ``order[i]``.

    HF stores each head's rotary pairs as halves (rotate-half); llama.cpp's normal RoPE wants them interleaved:
    per head the rows (h, 2, hd/2) are read as (h, hd/2, 2).
    """
    if rows % (2 * n_head):
        raise ValueError(f"Q/K permutation: {rows} rows are not {n_head} heads of an even head size")
    return np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(-1)


def _short(tensor: gguf.MODEL_TENSOR) -> str:
    """The per-block part of a GGUF tensor name (``"attn_q"`` of ``"blk.{bid}.attn_q"``)."""
    return gguf.TENSOR_NAMES[tensor].rpartition(".")[2]


_QKV = {_short(t) for t in (gguf.MODEL_TENSOR.ATTN_Q, gguf.MODEL_TENSOR.ATTN_K, gguf.MODEL_TENSOR.ATTN_V)}
_ROUTERS = {_short(t) for t in (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP)}
_EXPERTS = {_short(t) for t in (gguf.MODEL_TENSOR.FFN_GATE_EXP, gguf.MODEL_TENSOR.FFN_UP_EXP,
                                gguf.MODEL_TENSOR.FFN_DOWN_EXP)}


def _experts_module(model, param: str):
    owner, _, attr = param.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return None, attr
    return (module if models.is_experts_module(module) else None), attr


def targets(model, spec: Arch) -> dict:
    """Model parameter name -> list of :class:`Target` (empty: not written, e.g. a tied output head).

    Raises:
      UnsupportedGGUFModel: a parameter with no GGUF tensor in the architecture (biases, unknown modules).
    """
    cfg = model.config
    tmap = gguf.get_tensor_name_map(spec.arch, cfg.num_hidden_layers)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out = {}
    for param, tensor in model.state_dict().items():
        special = spec.special(model, spec, param, tmap) if spec.special is not None else None
        if special is not None:
            out[param] = special
            continue
        module, attr = _experts_module(model, param)
        bias = param.endswith(".bias")
        if module is not None:
            layout = models.ExpertsLayout.of(module)
            if layout.biased and not spec.expert_bias:
                _refuse(model, param, f"llama.cpp's {spec.name} loads no expert biases")
            if layout.post_norm or not layout.gated:
                _refuse(model, param, "experts with post-expert norms or no gate are not supported")
            base = param.rpartition(".")[0]
            bias = attr.endswith("_bias")
            gate, up = layout.gate_up_rows()
            if attr.removesuffix("_bias") == layout.up_name:   # a bias takes the same selection of its entries
                parts = [(f"{base}.gate_proj", gate), (f"{base}.up_proj", up)]
            elif attr.removesuffix("_bias") == "down_proj":
                parts = [(f"{base}.down_proj", None)]
            else:
                _refuse(model, param, "an experts parameter this exporter does not know")
        elif param.endswith(".weight"):
            parts = [(param[: -len(".weight")], None)]
        elif bias and spec.qkv_bias:
            parts = [(param[: -len(".bias")], None)]
        else:
            _refuse(model, param, f"no GGUF tensor for this parameter in llama.cpp's {spec.name}")
        entries = []
        for hf, rows in parts:
            for given, known in spec.aliases:
                hf = hf.replace(given, known)
            name = tmap.get_name(hf)
            if name is None:
                _refuse(model, param, f"no GGUF tensor for this parameter in llama.cpp's {spec.name}")
            kind = name.rpartition(".")[2] if name.startswith("blk.") else name
            suffix = ".bias" if bias else ".weight"
            if bias and kind not in (_EXPERTS if module is not None else _QKV):
                _refuse(model, param, f"llama.cpp's {spec.name} loads no {kind} bias")
            role, flat = "weight", False
            if suffix == ".bias":
                role = "bias"
            elif tensor.ndim == 1:
                role = "norm"
            elif kind in _ROUTERS:
                role = "router"
                flat = kind == _short(gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP) and tensor.shape[0] == 1
            elif name == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD]:
                role = "embedding"
            elif name == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT]:
                role = "output"
            heads = None
            if spec.permute_qk and role in ("weight", "bias"):
                if kind == _short(gguf.MODEL_TENSOR.ATTN_Q):
                    heads = int(cfg.num_attention_heads)
                elif kind == _short(gguf.MODEL_TENSOR.ATTN_K):
                    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
            entries.append(Target(name + suffix, rows, heads, role, flat))
        if tied and entries and entries[0].role == "output" and not spec.output_required:
            entries = []  # llama.cpp falls back to token_embd
        out[param] = entries
    return out


def gguf_names(model) -> dict:
    """Model parameter name (``state_dict`` naming) -> list of (GGUF tensor name, row slice or None).

    A fused gate_up expert parameter (E, 2I, H) gives two entries, ``blk.N.ffn_gate_exps.weight`` and
    ``blk.N.ffn_up_exps.weight``, with the slices of its nn.Linear-orientation rows each takes; a tied output
    head that llama.cpp does not load maps to an empty list.
    """
    return {p: [(t.name, t.rows) for t in ts] for p, ts in targets(model, arch_of(model)).items()}
