"""Tiny checkpoint folders written in the formats big MoE releases ship in, for tests.

Each writer saves a transformers model with ``save_pretrained`` (which writes the checkpoint names the real
releases use: per-expert ``mlp.experts.{e}.gate_proj.weight`` for DeepSeek/Qwen3, fused ``mlp.experts.gate_up_proj``
for gpt-oss), then rewrites the chosen weights in the quantized format and adds the release's
``quantization_config`` to config.json. One ``model.safetensors`` file, or with ``shards=N`` N files and the
``model.safetensors.index.json`` the releases have (:func:`read_checkpoint` reads either).
The encoders here are plain and independent of the readers under test; tests decode with their own float64 numpy.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# the FP4 e2m1 magnitudes, nibble codes 0..7 (bit 3 is the sign)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _save_float(model, path: str) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    return load_file(os.path.join(path, "model.safetensors"))


def _finish(path: str, tensors: dict[str, torch.Tensor], quantization_config: dict, shards: int = 1) -> None:
    """Write the tensors (``shards`` > 1: in that many files cut in name order, so that a weight and its
    companions may land in different files, with a ``model.safetensors.index.json``) and the config's
    ``quantization_config``."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    single = os.path.join(path, "model.safetensors")
    if shards <= 1:
        save_file(tensors, single, metadata={"format": "pt"})
    else:
        os.remove(single)
        names = sorted(tensors)
        cut = -(-len(names) // shards)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i * cut:(i + 1) * cut]}
            save_file(part, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)


def read_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor by checkpoint name), from one model.safetensors or from the shards
    an index names."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):
        return config, load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for file in files:
        tensors.update(load_file(os.path.join(path, file)))
    return config, tensors


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


def write_fp8_folder(model, path: str, block=128, ignore=(), scale_dtype=torch.float32, shards=1) -> None:
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
    _finish(path, out, qc, shards)


def encode_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., R, C) float, C a multiple of 32 -> blocks (..., R, C/32, 16) uint8 (low nibble = even element) and
    scales (..., R, C/32) uint8 E8M0 (shared exponent floor(log2(max)) - 2, OCP MX), values rounded to nearest."""
    w = np.asarray(w, dtype=np.float64)
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(g).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127).clip(-127, 127)
    x = np.abs(g) / np.exp2(exp)[..., None]
    code = np.abs(x[..., None] - E2M1).argmin(axis=-1).astype(np.uint8)
    code |= np.where(g < 0, 8, 0).astype(np.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def write_mxfp4_folder(model, path: str, shards=1) -> None:
    """A gpt-oss style folder: each layer's ``mlp.experts.gate_up_proj`` / ``down_proj`` (E, in, out) as
    ``*_blocks`` (E, out, in/32, 16) + ``*_scales`` (E, out, in/32); biases, attention, router stay float."""
    tensors = _save_float(model, path)
    out = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and name.endswith(("gate_up_proj", "down_proj")):
            blocks, scales = encode_mxfp4(t.to(torch.float64).transpose(1, 2).numpy())
            out[name + "_blocks"] = torch.from_numpy(blocks)
            out[name + "_scales"] = torch.from_numpy(scales)
        else:
            out[name] = t
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    _finish(path, out, qc, shards)


def write_pack_quantized_folder(model, path: str, num_bits=4, group_size=32, symmetric=True,
                                ignore=("lm_head",), shards=1) -> None:
    """A compressed-tensors ``pack-quantized`` folder (Kimi-K2-Thinking style: int4, group 32, symmetric): every
    decoder-layer linear weight not in ``ignore`` (exact names or ``re:`` regexes) quantized round-to-nearest from
    its group's max (asymmetric: min/max) and packed by compressed-tensors' own compressor; ``weight_scale`` in the
    model's dtype. ``group_size=None``: one scale per output channel (the channel strategy)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.utils.match import match_name

    strategy = "group" if group_size else "channel"
    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    qmax, qmin = 2 ** (num_bits - 1) - 1, -(2 ** (num_bits - 1))
    tensors = _save_float(model, path)
    out = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if not is_layer_linear(name, t) or any(match_name(module, pattern) for pattern in ignore):
            out[name] = t
            continue
        g = t.to(torch.float32).unflatten(-1, (-1, group_size or t.shape[-1]))
        if symmetric:
            scale = (g.abs().amax(-1) / qmax).clamp(min=1e-8).to(t.dtype)
            state = {"weight": t, "weight_scale": scale}
        else:
            lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
            scale = ((hi - lo) / (qmax - qmin)).clamp(min=1e-8).to(t.dtype)
            zero = (qmin - torch.round(lo / scale.to(torch.float32))).clamp(qmin, qmax).to(torch.int8)
            state = {"weight": t, "weight_scale": scale, "weight_zero_point": zero}
        for key, value in PackedQuantizationCompressor.compress(state, scheme).items():
            out[f"{module}.{key}"] = value
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": args.model_dump(mode="json"),
                                        "input_activations": None, "output_activations": None,
                                        "format": "pack-quantized"}},
          "ignore": list(ignore), "kv_cache_scheme": None}
    _finish(path, out, qc, shards)
