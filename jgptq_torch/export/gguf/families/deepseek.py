"""DeepSeek-V3 (and the models that reuse its transformers class): llama.cpp's ``deepseek2``.

Multi-head latent attention: llama.cpp runs it with the absorption of ``kv_b_proj`` into the query and output,
so the file holds ``kv_b_proj`` split per head into ``attn_k_b`` (the key rows, transposed: (heads, kv_lora_rank,
qk_nope_head_dim)) and ``attn_v_b`` (the value rows: (heads, v_head_dim, kv_lora_rank)); the attention is
multi-query over the compressed cache (``head_count_kv`` 1, key length kv_lora_rank + qk_rope_head_dim, value
length kv_lora_rank), with the per-head sizes under ``key_length_mla``/``value_length_mla``. Routing: sigmoid
scores, the correction bias ``exp_probs_b`` added for the choice only, group-limited top-k, optional
renormalisation, the routed scaling factor; the first ``first_k_dense_replace`` layers are dense.

A quantized ``kv_b_proj``: ``attn_v_b`` takes the record's blocks (whole rows of kv_lora_rank values);
``attn_k_b`` is a transpose, which no block can survive, so it is written in the float type from the record's
dequantized values (llama.cpp's quantizer encodes it on its own rows of qk_nope_head_dim values).
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from jgptq_torch.export.gguf.families.base import (Arch, Target, check_groups, correction_bias, refuse,
                                                   sigmoid_routing)


@dataclasses.dataclass(frozen=True)
class KVSplit:
    """The ``attn_k_b`` (``part="k"``) or ``attn_v_b`` (``part="v"``) half of a ``kv_b_proj`` weight of
    (heads * (nope + v), kv_lora_rank) rows."""

    part: str
    heads: int
    nope: int
    v: int

    @property
    def keeps_blocks(self) -> bool:
        """A record's blocks can be written as they are (whole rows, untransposed)."""
        return self.part == "v"

    def shape(self, full: tuple) -> tuple:
        """Logical GGUF shape (numpy order) from the parameter's (rows, kv_lora_rank)."""
        lora = full[-1]
        return (self.heads, lora, self.nope) if self.part == "k" else (self.heads, self.v, lora)

    def _heads(self, rows: np.ndarray) -> np.ndarray:
        if rows.shape[0] != self.heads * (self.nope + self.v):
            raise ValueError(f"kv_b_proj has {rows.shape[0]} rows, not heads {self.heads} x (qk_nope_head_dim "
                             f"{self.nope} + v_head_dim {self.v})")
        return rows.reshape((self.heads, self.nope + self.v) + rows.shape[1:])

    def floats(self, value: np.ndarray) -> np.ndarray:
        """float32 (heads, lora, nope) or (heads, v, lora) of the float (rows, lora) weight."""
        per_head = self._heads(value)
        return per_head[:, :self.nope].transpose(0, 2, 1) if self.part == "k" else per_head[:, self.nope:]

    def imatrix(self, sums: np.ndarray, counts: np.ndarray):
        """The importance entry of this half from kv_b_proj's (sums (1, lora), counts (1,)): ``attn_v_b`` is a
        stack of ``heads`` matrices on kv_b's input, so the entry once per head; ``attn_k_b`` multiplies the
        queries' no-rope part, an input the statistic does not describe: None."""
        if self.part == "k":
            return None
        return np.repeat(sums, self.heads, axis=0), np.repeat(counts, self.heads)

    def blocks(self, payload: np.ndarray) -> np.ndarray:
        """The record's blocks (heads, v, blocks, bytes) of ``attn_v_b`` (only: see :attr:`keeps_blocks`)."""
        return self._heads(payload)[:, self.nope:]


def _check(model, spec):
    cfg = model.config
    if not getattr(cfg, "rope_interleave", True):
        refuse(model, "rope_interleave=False", "llama.cpp's deepseek2 rotates interleaved pairs of the stored rows")
    check_groups(model, spec)


def _meta(cfg, meta, key):
    a = gguf.Keys.Attention
    lora, rope = int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
    meta[key(a.HEAD_COUNT_KV)] = 1
    meta[key(a.KEY_LENGTH)] = lora + rope
    meta[key(a.VALUE_LENGTH)] = lora
    meta[key(gguf.Keys.Rope.DIMENSION_COUNT)] = rope
    if getattr(cfg, "q_lora_rank", None):
        meta[key(a.Q_LORA_RANK)] = int(cfg.q_lora_rank)
    meta[key(a.KV_LORA_RANK)] = lora
    meta[key(a.KEY_LENGTH_MLA)] = int(cfg.qk_nope_head_dim) + rope
    meta[key(a.VALUE_LENGTH_MLA)] = int(cfg.v_head_dim)
    sigmoid_routing(cfg, meta, key)


def _special(model, spec, param, tmap):
    cfg = model.config
    owner = param.rpartition(".")[0]
    if param.endswith(".kv_b_proj.weight"):
        out = []
        for part, tensor in (("k", gguf.MODEL_TENSOR.ATTN_K_B), ("v", gguf.MODEL_TENSOR.ATTN_V_B)):
            name = tmap.get_name(owner.replace("kv_b_proj", f"{part}_b_proj"))
            split = KVSplit(part, int(cfg.num_attention_heads), int(cfg.qk_nope_head_dim), int(cfg.v_head_dim))
            out.append(Target(name + ".weight", split=split))
        return out
    return correction_bias(model, spec, param, tmap)


FAMILIES = [Arch("deepseek_v3", gguf.MODEL_ARCH.DEEPSEEK2, permute_qk=False, expert_ff="moe_intermediate_size",
                 check=_check, meta=_meta, special=_special)]
