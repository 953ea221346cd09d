"""Tiny checkpoint folders written in the formats big MoE releases ship in, for tests.

Each writer saves a transformers model with ``save_pretrained`` (which writes the checkpoint names the real
releases use: per-expert ``mlp.experts.{e}.gate_proj.weight`` for DeepSeek/Qwen3, fused ``mlp.experts.gate_up_proj``
for gpt-oss), then rewrites the chosen weights in the quantized format and adds the release's
``quantization_config`` to config.json. One ``model.safetensors`` file (tiny models need no index).
The encoders here are plain and independent of the readers under test; tests decode with their own float64 numpy.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

def _save_float(model, path: str) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    return load_file(os.path.join(path, "model.safetensors"))


def _finish(path: str, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)


def is_layer_linear(name: str, tensor: torch.Tensor) -> bool:
    """A decoder layer's linear weight (attention or MLP projection): 2-D ``model.layers.*.weight``, not a norm and
    not a router (``mlp.gate`` / ``mlp.router``)."""
    if not (name.startswith("model.layers.") and name.endswith(".weight") and tensor.ndim == 2):
        return False
    module = name[: -len(".weight")]
    last = module.rsplit(".", 1)[-1]
    return "norm" not in last and last not in ("gate", "router")


def encode_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) float -> float8_e4m3fn weight and (ceil(R/br), ceil(C/bc)) float32 ``weight_scale_inv``
    (block max-abs / 448; ragged edge blocks)."""
    w = w.to(torch.float32)
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    scale = torch.empty(nr, nc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = blk.abs().max() / 448.0
            s = torch.where(s > 0, s, torch.ones(()))
            scale[i, j] = s
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def write_fp8_folder(model, path: str, block=128, ignore=(), scale_dtype=torch.float32) -> None:
    """A DeepSeek-V3 / Qwen3-FP8 style folder: every decoder-layer linear weight (not routers, norms, embeddings,
    lm_head, nor the modules in ``ignore``) as float8_e4m3fn ``weight`` + ``weight_scale_inv`` blocks."""
    block = (block, block) if isinstance(block, int) else tuple(block)
    tensors = _save_float(model, path)
    out = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if is_layer_linear(name, t) and module not in ignore:
            q, s = encode_fp8_block(t, block)
            out[name], out[module + ".weight_scale_inv"] = q, s.to(scale_dtype)
        else:
            out[name] = t
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if ignore:
        qc["modules_to_not_convert"] = list(ignore)
    _finish(path, out, qc)
