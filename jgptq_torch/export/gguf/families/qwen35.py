"""Qwen3.5-MoE text models (``qwen3_5_moe_text``, transformers' ``Qwen3_5MoeForCausalLM``): llama.cpp's
``qwen35moe``.

Qwen3-Next's layers (:mod:`jgptq_torch.export.gguf.families.qwen3next`: the same norms, gates, experts and layer
pattern) with the linear attention's projections apart: ``in_proj_qkv`` (``attn_qkv``), ``in_proj_z``
(``attn_gate``), ``in_proj_b``/``in_proj_a`` (``ssm_beta``/``ssm_alpha``), and multimodal rotary sections
(``rope.dimension_sections``: the config's ``mrope_section``, else transformers' default; text positions are the
same in every section, so they rotate as plain rotary embedding).

With more value heads than key heads, llama.cpp wants the value heads tiled (every group's first value head, then
every group's second, ...) where transformers keeps each group's together: the value rows of ``in_proj_qkv``, the
rows of ``in_proj_z``/``in_proj_b``/``in_proj_a``, ``A_log``/``dt_bias`` and the convolution's value channels are
reordered (whole rows: a record's blocks are kept), and ``out_proj``'s input columns in runs of one value head: its
blocks are kept when a head's width is a multiple of the format's block, else it is written in the float type from
the record's dequantized values (with a warning).
"""

from __future__ import annotations

import dataclasses
import warnings

import gguf
import numpy as np

from jgptq_torch.export.gguf.families import qwen3next
from jgptq_torch.export.gguf.families.base import (
    Arch,
    ConvKernel,
    Target,
    head_dim,
    refuse,
    rope_parameters,
)
from jgptq_torch.export.gguf.families.qwen3next import Elementwise, Rows

_SECTIONS = (11, 11, 10)   # transformers' mrope_section when the config gives none


def value_order(cfg, width: int) -> np.ndarray:
    """int (value heads * width,): llama.cpp's tiled order of per-value-head runs of ``width`` entries."""
    nk, nv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    return np.arange(nv * width).reshape(nk, nv // nk, width).transpose(1, 0, 2).reshape(-1)


def _qkv_order(cfg) -> tuple:
    keys = 2 * int(cfg.linear_num_key_heads) * int(cfg.linear_key_head_dim)
    order = np.concatenate([np.arange(keys), keys + value_order(cfg, int(cfg.linear_value_head_dim))])
    return tuple(int(i) for i in order)


@dataclasses.dataclass(frozen=True)
class ReorderedConv(ConvKernel):
    """The convolution kernel (channels, width) with its channels in ``order``."""

    order: tuple = ()

    def floats(self, value: np.ndarray) -> np.ndarray:
        return super().floats(value)[list(self.order)]


@dataclasses.dataclass(frozen=True)
class Columns:
    """A weight (..., out, in) with its input columns in ``order``, which moves runs of ``unit`` columns."""

    order: tuple
    unit: int
    name: str

    def keeps_blocks(self, rec) -> bool:
        """Whether the record's blocks move whole (a run is a multiple of its block); warns when not."""
        if self.unit % rec.block_size == 0:
            return True
        warnings.warn(f"{self.name}: value heads of {self.unit} columns are reordered for llama.cpp and do not hold "
                      f"whole {rec.format} blocks ({rec.block_size}); written in the float type from the record's "
                      f"dequantized values", stacklevel=2)
        return False

    def shape(self, full: tuple) -> tuple:
        return full

    def floats(self, value: np.ndarray) -> np.ndarray:
        return value[..., list(self.order)]

    def blocks(self, payload: np.ndarray) -> np.ndarray:
        """The record's blocks (..., rows, blocks, bytes) in the order of their runs."""
        per_run = self.unit * payload.shape[-2] // len(self.order)
        runs = np.asarray(self.order[::self.unit]) // self.unit
        return payload[..., (runs[:, None] * per_run + np.arange(per_run)).reshape(-1), :]

    def imatrix(self, sums: np.ndarray, counts: np.ndarray):
        return sums[..., list(self.order)], counts


def _sections(cfg) -> list:
    return list(rope_parameters(cfg).get("mrope_section") or _SECTIONS)


def _check(model, spec):
    qwen3next.check(model, spec)
    cfg = model.config
    rotated = int(head_dim(cfg) * float(rope_parameters(cfg).get("partial_rotary_factor", 1.0)))
    if 2 * sum(_sections(cfg)) != rotated:
        refuse(model, f"mrope_section {_sections(cfg)}", f"llama.cpp's {spec.name} needs sections that cover the "
               f"{rotated // 2} rotated pairs of a head")


def _meta(cfg, meta, key):
    qwen3next.linear_attention_meta(cfg, meta, key, FAMILIES[0])
    meta[key(gguf.Keys.Rope.DIMENSION_SECTIONS)] = [int(s) for s in (_sections(cfg) + [0] * 4)[:4]]


def _special(model, spec, param, tmap):
    cfg = model.config
    if ".linear_attn." not in param:
        return qwen3next.norms(param, tmap)
    owner, _, attr = param.rpartition(".")
    hv = int(cfg.linear_value_head_dim)
    if attr == "weight" and owner.endswith(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        order = _qkv_order(cfg) if owner.endswith("qkv") else value_order(cfg, hv if owner.endswith("_z") else 1)
        return [Target(tmap.get_name(owner) + ".weight", split=Rows(tuple(int(i) for i in order)))]
    if attr == "weight" and owner.endswith(".out_proj"):
        name = tmap.get_name(owner) + ".weight"
        return [Target(name, split=Columns(tuple(int(i) for i in value_order(cfg, hv)), hv, name))]
    if param.endswith(".conv1d.weight"):
        return [Target(tmap.get_name(owner) + ".weight", role="norm", split=ReorderedConv(_qkv_order(cfg)))]
    heads = tuple(int(i) for i in value_order(cfg, 1))
    if attr == "A_log":
        return [Target(tmap.get_name(param), role="norm", split=Elementwise("-exp", heads))]
    if attr == "dt_bias":
        return [Target(tmap.get_name(param[: -len("_bias")] + "_proj") + ".bias", role="norm",
                       split=Elementwise("=", heads))]
    return None


FAMILIES = [Arch("qwen3_5_moe_text", gguf.MODEL_ARCH.QWEN35MOE, permute_qk=False, norm_topk=True,
                 norm_topk_default=True, expert_ff="moe_intermediate_size",
                 shared_ff="shared_expert_intermediate_size", check=_check, meta=_meta, special=_special)]
