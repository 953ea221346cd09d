"""Qwen3-Next (``qwen3_next``, transformers' ``Qwen3NextForCausalLM``): llama.cpp's ``qwen3next``.

A hybrid of gated-delta-net (linear attention) layers and gated full-attention layers, every one followed by
softmax-routed experts (always renormalised) and a shared expert behind a sigmoid gate.

- Layer kinds: llama.cpp reads them from ``full_attention_interval`` (every n-th layer full attention), so
  ``layer_types`` must follow that pattern (the released models do, with n = 4).
- Full attention: ``q_proj`` gives each head's query and output gate side by side (``attn_q``, twice the head
  rows); per-head Q/K norms; NeoX rotary embedding on the first ``partial_rotary_factor`` of each head.
- Linear attention: ``in_proj_qkvz`` holds, per key-head group, that group's query, key, value and gate rows;
  llama.cpp wants every query row, then every key row, then every value row (``attn_qkv``) and the gate rows apart
  (``attn_gate``): a reordering of whole rows, so a record's blocks are written as they are. ``in_proj_ba``
  (``ssm_ba``) and ``out_proj`` (``ssm_out``) are ordinary weights. Floating point always: the short convolution
  (``ssm_conv1d``, (channels, width)), ``dt_bias`` (``ssm_dt.bias``), ``A_log`` written as the decay rate
  ``-exp(A_log)`` (``ssm_a``), the gated norm (``ssm_norm``).
- RMS norms but the gated one scale by ``1 + weight`` in transformers: the file holds ``1 + weight``.

``-exp`` and ``+ 1`` are computed in float32 from the model's tensors, as transformers computes them (llama.cpp's
converter computes them in the checkpoint's dtype: the same bytes for a float32 checkpoint).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import torch

from jgptq_torch.export.gguf.families.base import (
    Arch,
    ConvKernel,
    Target,
    head_dim,
    refuse,
    require_every_layer_moe,
    rope_parameters,
)

LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Rows:
    """Some rows of a weight (..., out, in), in the given order: whole rows, so a record's blocks are kept."""

    rows: tuple
    keeps_blocks = True

    def shape(self, full: tuple) -> tuple:
        return full[:-2] + (len(self.rows), full[-1])

    def floats(self, value: np.ndarray) -> np.ndarray:
        return value[..., list(self.rows), :]

    def blocks(self, payload: np.ndarray) -> np.ndarray:
        """The record's blocks (..., rows, blocks, bytes) of these rows."""
        return payload[..., list(self.rows), :, :]

    def imatrix(self, sums: np.ndarray, counts: np.ndarray):
        return sums, counts   # the same input


@dataclasses.dataclass(frozen=True)
class Elementwise:
    """A float vector written as ``-exp(value)``, ``value + 1`` or ``value`` (``what``: "-exp", "+1", "="; float32 in
    and out), its entries then taken in ``order`` (None: as they are); never a record."""

    what: str
    order: tuple | None = None
    keeps_blocks = False

    def shape(self, full: tuple) -> tuple:
        return full

    def floats(self, value: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.ascontiguousarray(value, np.float32))
        out = {"-exp": lambda: -torch.exp(x), "+1": lambda: x + 1.0, "=": lambda: x}[self.what]().numpy()
        return out if self.order is None else out[..., list(self.order)]

    def imatrix(self, sums, counts):
        return None


NEG_EXP, PLUS_ONE = Elementwise("-exp"), Elementwise("+1")


def qkvz_rows(cfg) -> tuple:
    """(attn_qkv rows, attn_gate rows) of ``in_proj_qkvz``: per key-head group its query (key head width), key,
    values and gates (value heads per key head x value head width) rows, regrouped by kind."""
    nk, nv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    hk, hv = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
    vz = nv // nk * hv
    group = np.arange(nk * (2 * hk + 2 * vz)).reshape(nk, 2 * hk + 2 * vz)
    q, k, v, z = np.split(group, np.cumsum([hk, hk, vz]), axis=1)
    qkv = np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    return tuple(int(i) for i in qkv), tuple(int(i) for i in z.reshape(-1))


def full_attention_interval(model, spec) -> int:
    """n such that layer i is full attention exactly when (i + 1) % n == 0 (llama.cpp's only layer pattern)."""
    kinds = list(model.config.layer_types)
    fulls = [i for i, t in enumerate(kinds) if t == FULL]
    n = fulls[0] + 1 if fulls else len(kinds) + 1
    if kinds != [FULL if (i + 1) % n == 0 else LINEAR for i in range(len(kinds))]:
        refuse(model, f"layer_types {kinds}", f"llama.cpp's {spec.name} makes every n-th layer full attention and "
               f"the others linear attention (full_attention_interval)")
    return n


def check(model, spec):
    """The refusals of Qwen3-Next's and Qwen3.5's linear-attention families."""
    cfg = model.config
    require_every_layer_moe(model, spec)
    full_attention_interval(model, spec)
    if int(cfg.linear_key_head_dim) != int(cfg.linear_value_head_dim):
        refuse(model, f"linear_value_head_dim {cfg.linear_value_head_dim}", f"llama.cpp's {spec.name} sizes the "
               f"linear attention's value heads as its key heads ({cfg.linear_key_head_dim})")


def linear_attention_meta(cfg, meta, key, spec):
    """The linear attention's ``ssm.*`` keys, the layer pattern and the partial rotary width."""
    s = gguf.Keys.SSM
    model = type(spec.model_type, (), {"config": cfg})()
    meta[key(s.CONV_KERNEL)] = int(cfg.linear_conv_kernel_dim)
    meta[key(s.STATE_SIZE)] = int(cfg.linear_key_head_dim)
    meta[key(s.GROUP_COUNT)] = int(cfg.linear_num_key_heads)
    meta[key(s.TIME_STEP_RANK)] = int(cfg.linear_num_value_heads)
    meta[key(s.INNER_SIZE)] = int(cfg.linear_value_head_dim) * int(cfg.linear_num_value_heads)
    meta[key(gguf.Keys.LLM.FULL_ATTENTION_INTERVAL)] = full_attention_interval(model, spec)
    partial = float(rope_parameters(cfg).get("partial_rotary_factor", 1.0))
    meta[key(gguf.Keys.Rope.DIMENSION_COUNT)] = int(head_dim(cfg) * partial)


def _meta(cfg, meta, key):
    linear_attention_meta(cfg, meta, key, FAMILIES[0])


def norms(param, tmap):
    """The zero-centred RMS norms (all but the linear attention's gated one) as ``1 + weight``, or None."""
    if param.endswith("norm.weight") and not param.endswith(".linear_attn.norm.weight"):
        return [Target(tmap.get_name(param[: -len(".weight")]) + ".weight", role="norm", split=PLUS_ONE)]
    return None


def _special(model, spec, param, tmap):
    owner, _, attr = param.rpartition(".")
    if param.endswith(".linear_attn.in_proj_qkvz.weight"):
        bid = int(param.split(".")[2])
        qkv, z = qkvz_rows(model.config)
        return [Target(gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight", split=Rows(rows))
                for t, rows in ((gguf.MODEL_TENSOR.ATTN_QKV, qkv), (gguf.MODEL_TENSOR.ATTN_GATE, z))]
    if owner.endswith(".linear_attn") and attr == "A_log":
        return [Target(tmap.get_name(param), role="norm", split=NEG_EXP)]
    if owner.endswith(".linear_attn") and attr == "dt_bias":
        return [Target(tmap.get_name(owner + ".dt_proj") + ".bias", role="norm")]
    if param.endswith(".linear_attn.conv1d.weight"):
        return [Target(tmap.get_name(owner) + ".weight", role="norm", split=ConvKernel())]
    return norms(param, tmap)


FAMILIES = [Arch("qwen3_next", gguf.MODEL_ARCH.QWEN3NEXT, permute_qk=False, norm_topk=True, norm_topk_default=True,
                 expert_ff="moe_intermediate_size", shared_ff="shared_expert_intermediate_size", check=check,
                 meta=_meta, special=_special)]
