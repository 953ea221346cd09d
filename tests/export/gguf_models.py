"""Tiny models of the GGUF families, and GGML records of their weights encoded with jgptq's plain encoder."""

import types

import gguf
import numpy as np
import torch

from jgptq.export.records import GGMLWeight
from jgptq.ggml import encode
from jgptq.ggml.registry import get_format
from tests.tiny_models import build

# hidden and expert widths of 256: every K/IQ format (block 256) fits every weight
SIZES = {
    "llama": dict(hidden_size=256, intermediate_size=256, head_dim=64),
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256, head_dim=64),
    "mixtral": dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
    "olmoe": dict(hidden_size=256, intermediate_size=256, num_key_value_heads=4),
    "qwen2_moe": dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                      shared_expert_intermediate_size=256),
}


def tiny(family: str, seed: int = 0):
    return build(family, seed=seed, **SIZES[family])


def is_target(name: str, param) -> bool:
    """The weights a GGML quantization run holds records for: 2-D/3-D weights but routers, norms, embeddings
    and the output head."""
    return (param.ndim >= 2 and ".mlp.gate." not in name and "shared_expert_gate" not in name and "embed" not in name
            and "lm_head" not in name)


def quantize_in_place(model, fmt: str, only=None) -> types.SimpleNamespace:
    """Encodes every target weight of ``model`` (or the parameters named in ``only``) in ``fmt`` (nn.Linear
    orientation, also for experts stored (E, in, out)), writes the decoded values back, and returns a result
    whose ``weights`` are keyed by parameter name (fused stacks whole)."""
    from jgptq_torch import models

    f = get_format(fmt)
    weights = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (is_target(name, p) if only is None else name in only):
                continue
            owner = model.get_submodule(name.rpartition(".")[0])
            transposed = (p.ndim == 3 and models.is_experts_module(owner)
                          and models.ExpertsLayout.of(owner).transposed)   # stored (E, in, out)
            view = p.transpose(1, 2) if transposed else p
            w = view.detach().float().numpy()
            payload = np.asarray(encode(w, fmt)).reshape(w.shape[:-1] + (w.shape[-1] // f.block_size, f.type_size))
            rec = GGMLWeight(payload, fmt, method="rtn")
            view.copy_(torch.from_numpy(np.array(rec.dequantize())))
            weights[name] = rec
    return types.SimpleNamespace(weights=weights, param_keys={name: [name] for name in weights})


def per_expert(model, result) -> types.SimpleNamespace:
    """The same records under the checkpoint keys of ``save_pretrained`` (per-expert names where it has them)."""
    from jgptq_torch import checkpoint_keys

    params = {}
    for name, rec in result.weights.items():
        shape = rec.shape
        params[name] = (shape[0] if len(shape) == 3 else None, shape[-2], False)
    places = checkpoint_keys.checkpoint_names(model, params)
    weights, keys = {}, {}
    for name, entries in places.items():
        rec = result.weights[name]
        for key, expert, rows in entries:
            rows = rows.numpy()
            sub = rec if expert is None else rec[expert]
            if expert is not None or len(rec.shape) == 2:
                sub = GGMLWeight(sub.payload[rows], sub.format, method=sub.method)
            weights[key] = sub
            keys.setdefault(name, []).append(key)
    return types.SimpleNamespace(weights=weights, param_keys=keys)


def read(path):
    """(reader, name -> tensor) of a GGUF file, through the gguf package's own reader."""
    r = gguf.GGUFReader(str(path))
    return r, {t.name: t for t in r.tensors}


def field(reader, key):
    """The value of a metadata key: a string, a number, or a list of them."""
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    return f.parts[f.data[0]][0].item()


def flat_imatrix(path: str) -> dict:
    """A flat importance (all ones) for every weight matrix of a layer of the GGUF file at ``path``, in the form
    llama.cpp's quantizer takes: tensor name -> (columns x experts,) float32."""
    imatrix = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("blk.") and len(t.shape) >= 2:
            experts = int(t.shape[2]) if len(t.shape) > 2 else 1
            imatrix[t.name] = np.ones(int(t.shape[0]) * experts, np.float32)
    return imatrix
