"""Where each row of a quantization target lands in a checkpoint written by ``save_pretrained``: transformers' own
reverse weight conversion applied to proxies of the targets (fused experts split into per-expert keys, renamed
modules, keys that transformers splits or interleaves on load)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from jgptq_torch.models import ExpertsLayout, UnsupportedModelError, is_experts_module


def row_index(rows: torch.Tensor):
    """A numpy index for the row indices ``rows`` of :func:`checkpoint_names`: a slice when they are one increasing
    run (indexing then gives a view, not a copy), else the numpy array."""
    rows = rows.numpy()
    if rows.size and rows[-1] - rows[0] == rows.size - 1 and np.array_equal(rows, np.arange(rows[0], rows[-1] + 1)):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return rows


def name_spec(model: nn.Module, param: str) -> tuple:
    """The :func:`checkpoint_names` entry of a weight parameter of ``model``: (number of experts, or None for a 2-D
    weight; its output rows in nn.Linear orientation; whether the experts module stores it transposed)."""
    tensor = model.get_parameter(param)
    module = model.get_submodule(param.rpartition(".")[0])
    transposed = is_experts_module(module) and ExpertsLayout.of(module).transposed
    return (tensor.shape[0] if tensor.ndim == 3 else None, tensor.shape[-1] if transposed else tensor.shape[-2],
            transposed)


def checkpoint_names(model: nn.Module, params: dict) -> dict:
    """Where the output rows of each target land in a ``save_pretrained`` checkpoint.

    Args:
      model: the transformers model.
      params: qualified parameter name -> (num_experts or None, out_features, transposed): 2-D linear weights
        (None) or 3-D fused expert weights.
    Returns:
      qualified parameter name -> list of (checkpoint key, expert index or None for a fused key, row indices
      (LongTensor) of the nn.Linear-orientation (out, in) matrix that the key holds).
    """
    proxies, spans, base = {}, {}, 0
    for name, (experts, out, transposed) in params.items():
        n = (experts or 1) * out
        ids = base + torch.arange(n, dtype=torch.int64)
        if experts is None:
            proxies[name] = ids.reshape(out, 1)
        else:
            ids = ids.reshape(experts, out)
            proxies[name] = ids[:, None, :] if transposed else ids[:, :, None]
        spans[name] = (base, experts, out)
        base += n
    try:
        from transformers.core_model_loading import revert_weight_conversion

        reverted = revert_weight_conversion(model, dict(proxies))
    except Exception:  # noqa: BLE001 -- no conversion machinery: keys stay as they are
        reverted = proxies
    owner, shared = {}, {}
    for key, tensor in reverted.items():
        flat = tensor.reshape(-1)
        if flat.numel() == 0:
            continue
        first, last = int(flat.min()), int(flat.max())
        for name, (start, experts, out) in spans.items():
            if start <= first < start + (experts or 1) * out:
                owner.setdefault(name, []).append((key, flat - start, experts, out))
                if last >= start + (experts or 1) * out:
                    shared[key] = [n for n, (s, e, o) in spans.items() if s <= last and first < s + (e or 1) * o]
                break
    if shared:
        key, params = next(iter(shared.items()))
        raise UnsupportedModelError(
            f"checkpoint key {key!r} holds the rows of several quantized parameters ({', '.join(params)}): "
            f"transformers splits it into them on load, and jgptq's records hold one parameter's matrix each")
    names = {}
    for name, entries in owner.items():
        rows = []
        for key, local, experts, out in entries:
            if experts is None:
                rows.append((key, None, local))
                continue
            expert_ids = torch.unique(local // out)
            if len(expert_ids) == 1:
                rows.append((key, int(expert_ids[0]), local % out))
            else:
                rows.append((key, None, local))
        names[name] = rows
    missing = set(params) - set(names)
    if missing:
        raise UnsupportedModelError(f"checkpoint names could not be derived for {sorted(missing)}")
    return names
