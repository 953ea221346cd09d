"""The shape of one family's entry (:class:`Arch`), where a parameter goes in the file (:class:`Target`) and the config
readers every family shares."""

from __future__ import annotations

import dataclasses
from typing import Callable

import gguf
import numpy as np


class UnsupportedGGUFModel(ValueError):
    """The model (or one of its settings) has no faithful llama.cpp GGUF counterpart in this exporter."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Where (part of) a model parameter goes in the GGUF file.

    Attributes:
      name: GGUF tensor name.
      rows: rows of the parameter's nn.Linear-orientation (..., out, in) view it takes (None: all); of a bias
        (role ``"bias"``, (..., out)), the entries of its last axis.
      heads: Q/K head count when the rows are permuted for llama.cpp's RoPE (None: no permutation).
      role: ``"norm"``, ``"bias"``, ``"router"``, ``"embedding"``, ``"output"`` or ``"weight"``.
      flat: written as a vector (a (1, n) parameter llama.cpp loads as {n}, e.g. the shared expert's gate).
      split: a family's rearrangement of the parameter (e.g. deepseek2's ``attn_k_b``/``attn_v_b`` halves of
        ``kv_b_proj``): ``shape(full)``, ``floats(value)`` of the float (..., out, in) weight, and, where
        ``keeps_blocks`` (a bool, or a test of the record), ``blocks(payload)`` of a record (else the tensor is
        written in the float type from the record's dequantized values), and ``imatrix(sums, counts)``: its
        importance entry, or None.
    """

    name: str
    rows: slice | None = None
    heads: int | None = None
    role: str = "weight"
    flat: bool = False
    split: object = None


@dataclasses.dataclass(frozen=True)
class Arch:
    """A supported family: what llama.cpp's architecture for it expects.

    Attributes:
      model_type: transformers ``config.model_type``.
      arch: the llama.cpp architecture (a ``gguf.MODEL_ARCH``; its tensor names come from ``gguf.TensorNameMap``).
      permute_qk: llama.cpp applies the "normal" (interleaved-pair) RoPE, so Q and K rows are permuted from HF's
        rotate-half order.
      output_required: llama.cpp loads ``output.weight`` unconditionally (tied embeddings are written twice).
      norm_topk: the top-k renormalisation llama.cpp hard-codes for the family (None: dense, or read from the
        file's metadata).
      norm_topk_default: ``norm_topk_prob`` of a config that does not set it.
      expert_ff: config attribute of the expert width (None: the family writes none).
      shared_ff: config attribute of the shared expert's width (None: no shared expert).
      qkv_bias: llama.cpp loads Q/K/V biases for the family (and the model may have them).
      expert_bias: llama.cpp loads biases of the experts (``ffn_{gate,up,down}_exps.bias``), which the model's
        experts (transformers' ``has_bias``) then give; otherwise biased experts are refused.
      window_from_layer_types: the config's ``sliding_window`` applies only to the layers ``layer_types`` marks
        as sliding (the family's check refuses those, or the layouts llama.cpp's graph does not follow); otherwise
        any ``sliding_window`` is refused.
      rope_types: rope types the family's llama.cpp graph computes besides ``default``, ``linear`` and ``llama3``
        (``"yarn"``: the scaling type, factor, original context and beta keys are written; any other type is
        handled by the family's own ``check`` and ``meta``, which refuse the settings its loader does not read).
      aliases: (transformers module-name part, the checkpoint's) pairs applied before the ``gguf`` name map,
        for modules transformers names differently from the checkpoints the map knows.
      check: family-specific refusals, ``check(model, spec)``; raises :class:`UnsupportedGGUFModel`.
      meta: family-specific metadata, ``meta(cfg, meta, key)`` updates ``meta`` in place (``key`` formats a
        ``gguf.Keys`` template with the architecture name).
      special: tensors the name map alone does not give, ``special(model, spec, param, tmap)`` -> list of
        ``Target`` or None (the generic mapping).
    """

    model_type: str
    arch: gguf.MODEL_ARCH
    permute_qk: bool
    output_required: bool = False
    norm_topk: bool | None = None
    norm_topk_default: bool = False
    expert_ff: str | None = None
    shared_ff: str | None = None
    qkv_bias: bool = False
    expert_bias: bool = False
    window_from_layer_types: bool = False
    rope_types: tuple = ()
    aliases: tuple = ()
    check: Callable | None = None
    meta: Callable | None = None
    special: Callable | None = None

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.arch]


def refuse(model, setting: str, why: str):
    """Raises :class:`UnsupportedGGUFModel` naming the model class, the setting and the reason."""
    raise UnsupportedGGUFModel(f"{type(model).__name__}: {setting}: {why}")


def head_dim(cfg) -> int:
    """Attention head width: ``cfg.head_dim``, else hidden_size / heads."""
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def num_experts(cfg) -> int | None:
    """Routed expert count of the config (None: a dense model)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    return None


def rope_parameters(cfg) -> dict:
    """The rotary settings (``rope_type``, ``rope_theta``, scaling keys) from transformers 5's ``rope_parameters``
    or the older ``rope_theta`` / ``rope_scaling``."""
    params = getattr(cfg, "rope_parameters", None) or {}
    params = params.get("full_attention", params)
    if not params:
        params = {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
        if getattr(cfg, "rope_scaling", None):
            params.update(cfg.rope_scaling)
            params.setdefault("rope_type", params.get("type", "default"))
    return dict(params)


def require_mha_width(model, spec: Arch) -> None:
    """Refuses Q/K/V widths other than the embedding width (families whose llama.cpp graph hard-codes it)."""
    cfg = model.config
    if head_dim(cfg) * cfg.num_attention_heads != cfg.hidden_size:
        refuse(model, f"head_dim {head_dim(cfg)}", f"llama.cpp's {spec.name} needs head_dim x heads == hidden_size")


def require_every_layer_moe(model, spec: Arch) -> None:
    """Refuses dense layers in a family whose llama.cpp graph has experts in every layer."""
    cfg = model.config
    if getattr(cfg, "mlp_only_layers", None) or getattr(cfg, "decoder_sparse_step", 1) != 1:
        refuse(model, "mlp_only_layers/decoder_sparse_step", f"llama.cpp's {spec.name} has experts in every layer")


def sigmoid_routing(cfg, meta, key, *, always_norm: bool = False) -> None:
    """The routing keys of DeepSeek-V3-style routers (sigmoid scores, a choice-only correction bias, group-limited
    top-k, optional renormalisation, a routed scaling factor) and their dense leading layers and shared experts;
    ``always_norm`` writes ``expert_weights_norm`` also when False."""
    k = gguf.Keys.LLM
    meta[key(k.LEADING_DENSE_BLOCK_COUNT)] = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
    meta[key(k.EXPERT_SHARED_COUNT)] = int(getattr(cfg, "n_shared_experts", 0) or 0)
    meta[key(k.EXPERT_WEIGHTS_SCALE)] = float(cfg.routed_scaling_factor)
    if always_norm or getattr(cfg, "norm_topk_prob", False):
        meta[key(k.EXPERT_WEIGHTS_NORM)] = bool(getattr(cfg, "norm_topk_prob", False))
    meta[key(k.EXPERT_GROUP_COUNT)] = int(getattr(cfg, "n_group", 1) or 1)
    meta[key(k.EXPERT_GROUP_USED_COUNT)] = int(getattr(cfg, "topk_group", 1) or 1)
    meta[key(k.EXPERT_GATING_FUNC)] = gguf.ExpertGatingFuncType.SIGMOID.value  # transformers' router


def check_groups(model, spec) -> None:
    """Refuses routed experts that do not split into ``n_group`` groups."""
    cfg = model.config
    experts, groups = num_experts(cfg), int(getattr(cfg, "n_group", 1) or 1)
    if experts % groups:
        refuse(model, f"n_group={groups}", f"{experts} experts do not split into {groups} groups")


def correction_bias(model, spec, param, tmap):
    """The router's ``e_score_correction_bias`` as ``blk.N.exp_probs_b.bias`` (float32), or None."""
    if param.endswith(".e_score_correction_bias"):
        return [Target(tmap.get_name(param[: -len("_bias")]) + ".bias", role="norm")]
    return None


@dataclasses.dataclass(frozen=True)
class ConvKernel:
    """A depthwise convolution weight (channels, 1, width) as llama.cpp's (channels, width), kept in floating
    point (no record's blocks: the exporter refuses records for it)."""

    keeps_blocks = False

    def shape(self, full: tuple) -> tuple:
        return (full[0], full[-1])

    def floats(self, value: np.ndarray) -> np.ndarray:
        return value.reshape(value.shape[0], value.shape[-1])

    def imatrix(self, sums, counts):
        return None
