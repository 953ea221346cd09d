"""GGML formats in the layerwise pipeline: which format each weight gets, its importance, its records, and the
importance statistic (imatrix) of every weight.

- :func:`choose_formats`: before any work, the format of every target weight (``PipelineConfig.formats`` rules,
  ``mix`` presets, ``quant.format``; :mod:`jgptq.mixes`), with the block-size check: a weight whose input columns
  are not a whole number of its format's blocks is an error, or (``block_fallback``) gets the fallback format, with a
  warning in the report;
- :func:`layer_imatrix`: the statistic of one calibrated layer by model parameter name
  (:class:`jgptq.imatrix.ImatrixEntry`: per expert, routed tokens only);
- :func:`importance_of`: the per-column importance handed to the encoders (``PipelineConfig.importance``);
- :func:`store_ggml`: a part's payload split into :class:`jgptq.export.GGMLWeight` records per checkpoint key.
"""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from jgptq import mixes
from jgptq.export.records import GGMLWeight
from jgptq.imatrix import ImatrixEntry


def target_weights(prefix: str, layer_idx: int, target):
    """(model parameter name, name relative to the layer, input columns, stacked matrices E or None) of every
    weight of a layer's targets."""
    base = f"{prefix}.{layer_idx}"
    out = [(f"{base}.{n}.weight", n, m.in_features, None) for n, m in target.linears.items()]
    for n, (_, lay) in target.experts.items():
        out.append((f"{base}.{n}.{lay.up_name}", f"{n}.{lay.up_name}", lay.hidden, lay.num_experts))
        out.append((f"{base}.{n}.down_proj", f"{n}.down_proj", lay.inter, lay.num_experts))
    return out


def choose_formats(prefix: str, targets: list, cfg) -> tuple[dict, list]:
    """The GGML format of every target weight, by model parameter name, and the fallback warnings.

    Raises:
      ValueError: a weight whose input columns are not a multiple of its format's block size (with
        ``block_fallback="error"``, or when the fallback does not fit either).
    """
    from jgptq.ggml import get_format

    n_layers = len(targets)
    n_expert = max([lay.num_experts for t in targets for _, lay in t.experts.values()] or [0])
    formats, notes = {}, []
    for i, t in enumerate(targets):
        for param, rel, cols, _ in target_weights(prefix, i, t):
            fmt = mixes.format_for(cfg, rel, i, n_layers, n_expert)
            block = get_format(fmt).block_size
            if cols % block:
                fallback = cfg.block_fallback
                if fallback == "llama.cpp":
                    fallback = mixes.LLAMA_FALLBACK.get(fmt, "error")
                if fallback == "error" or cols % get_format(fallback).block_size:
                    raise ValueError(
                        f"{param}: {cols} input columns are not a multiple of the {fmt} block size {block}"
                        + ("" if fallback == "error" else f", nor of the fallback {fallback}'s")
                        + "; choose another format for it with formats=[(regex, format)], a fallback with "
                          "block_fallback='llama.cpp' or a format name, or leave it unquantized with exclude=[...]")
                notes.append(f"{param}: {cols} input columns are not a multiple of the {fmt} block size {block}; "
                             f"{fallback} used instead (block_fallback)")
                fmt = fallback
            formats[param] = fmt
    return formats, notes


def check_imatrix(given: Mapping, prefix: str, targets: list) -> None:
    """Checks a user-given imatrix (parameter name -> ImatrixEntry) against every target weight, before any work.

    Raises:
      ValueError: a missing weight, or an entry of the wrong shape.
    """
    for i, t in enumerate(targets):
        for param, _, cols, experts in target_weights(prefix, i, t):
            entry = given.get(param)
            if entry is None:
                raise ValueError(f"imatrix: no entry for {param} (entries are keyed by model parameter name, as "
                                 f"QuantizeResult.imatrix is)")
            sums = np.asarray(entry.sums)
            want = (experts or 1, cols)
            if sums.reshape(-1, sums.shape[-1]).shape != want or np.asarray(entry.counts).size != want[0]:
                raise ValueError(f"imatrix: entry {param} has sums {sums.shape} and counts "
                                 f"{np.asarray(entry.counts).shape}; expected sums {want} and counts ({want[0]},)")


def layer_imatrix(collector, prefix: str, layer_idx: int, target) -> dict:
    """The importance statistic of a calibrated layer: model parameter name -> :class:`ImatrixEntry` (an expert
    or a module never reached has zero sums and a zero count)."""
    out = {}
    keys = {n: collector.tie.get(n) for n in target.linears}
    for n, (_, lay) in target.experts.items():
        keys[f"{n}.{lay.up_name}"] = (n, "gate_up")
        keys[f"{n}.down_proj"] = (n, "down")
    for param, rel, cols, experts in target_weights(prefix, layer_idx, target):
        key = keys[rel]
        got = None if key is None else collector.importance_statistic(key)
        if got is None:
            got = (np.zeros((experts or 1, cols), np.float32), np.zeros((experts or 1,), np.float32))
        out[param] = ImatrixEntry(*got)
    return out


def layer_entries(imatrix: Mapping, prefix: str, layer_idx: int, target) -> dict:
    """The entries of ``imatrix`` that belong to the weights of one layer."""
    return {p: imatrix[p] for p, _, _, _ in target_weights(prefix, layer_idx, target) if p in imatrix}


def importance_of(cfg, entry: Optional[ImatrixEntry], hessian, tokens, n: int):
    """float32 (N, C) importance of a part for the GGML encoders, or None (``importance="none"``).

    Args:
      entry: the weight's imatrix entry (collected or given); hessian: the part's Hessian (C, C), (N, C, C) or
        None; tokens: the N token counts; n: N.
    """
    if cfg.importance == "none":
        return None
    if cfg.importance == "imatrix":
        values = entry.values()
        return np.broadcast_to(values.reshape(-1, values.shape[-1]), (n, values.shape[-1])).astype(np.float32)
    # the Hessian diagonal (2/N sum x^2); a matrix that saw no token gets 1.0 everywhere, as in llama.cpp
    if hessian is None:
        return None if entry is None else np.ones((n, entry.sums.shape[-1]), np.float32)
    import jax.numpy as jnp

    diag = np.asarray(jnp.diagonal(jnp.asarray(hessian), axis1=-2, axis2=-1), np.float32)
    diag = np.broadcast_to(diag.reshape(-1, diag.shape[-1]), (n, diag.shape[-1])).copy()
    diag[np.asarray(tokens).reshape(-1) == 0] = 1.0
    return diag


def store_ggml(weights: dict, names: dict, part, res) -> None:
    """Splits a part's payload into checkpoint tensors (per-expert names where the checkpoint has them) as
    :class:`GGMLWeight` records (as ``_store`` does for integer grids)."""
    payload = np.asarray(res.payload)
    from interop.models import UnsupportedModelError, row_index

    for key, expert, rows in names[part.param]:
        if part.kind == "linear" or expert is not None:
            e = 0 if expert is None else expert
            weights[key] = GGMLWeight(payload[e][row_index(rows)], res.format, method=res.method[e],
                                      transposed=part.transposed)
        else:
            n, r = payload.shape[:2]
            if not np.array_equal(rows.numpy(), np.arange(n * r)):
                raise UnsupportedModelError(f"{key}: checkpoint rows of a fused key are reordered")
            methods = set(res.method)
            weights[key] = GGMLWeight(payload, res.format, method=methods.pop() if len(methods) == 1 else "mixed",
                                      transposed=part.transposed)
