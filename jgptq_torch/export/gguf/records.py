"""A quantization result's GGML records as one :class:`GGMLWeight` per model parameter, the form a GGUF tensor
takes: records kept per checkpoint key (one expert's rows, a fused stack) are stacked back by where their rows
land (:func:`jgptq_torch.checkpoint_keys.checkpoint_names`)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from jgptq_torch import checkpoint_keys
from jgptq.export.records import GGMLWeight


def assemble(model, result, params: dict) -> dict:
    """Model parameter name -> one :class:`GGMLWeight` covering the whole parameter in (..., out, in) orientation.

    ``result.weights`` is keyed by parameter names, or by checkpoint keys listed in ``result.param_keys``
    (per-expert keys are stacked back with :func:`jgptq_torch.checkpoint_keys.checkpoint_names`).
    """
    weights = dict(result.weights)
    check_ggml(weights)
    param_keys = dict(getattr(result, "param_keys", None) or {})
    if not param_keys:
        unknown = [k for k in weights if k not in params]
        if unknown:
            raise ValueError(f"result.weights keys {unknown[:4]} are not model parameters and result.param_keys "
                             f"does not say which parameters they belong to")
        param_keys = {k: [k] for k in weights}
    used, out, indirect = set(), {}, {}
    for param, keys in param_keys.items():
        if param not in params:
            raise ValueError(f"result.param_keys names {param!r}, which is not a parameter of the model")
        keys = list(keys)
        missing = [k for k in keys if k not in weights]
        if missing:
            raise ValueError(f"{param}: checkpoint keys {missing[:4]} are missing from result.weights")
        used.update(keys)
        if len(params[param]) < 2:
            raise ValueError(f"{param}: a {len(params[param])}-D tensor (a norm or bias) stays in floating point in "
                             f"llama.cpp; leave it out of the result")
        if not _direct(keys, weights, params[param]):
            indirect[param] = keys
    unused = set(weights) - used
    if unused:
        raise ValueError(f"result.weights keys {sorted(unused)[:4]} belong to no parameter in result.param_keys")
    places = row_places(model, indirect)
    for param, keys in param_keys.items():
        out[param] = param_record(param, params[param], list(keys), weights, places.get(param))
    return out


def check_ggml(records: dict) -> None:
    """Raises ValueError for a record (checkpoint key -> record) that is not a :class:`GGMLWeight`."""
    for key, rec in records.items():
        if not isinstance(rec, GGMLWeight):
            raise ValueError(f"{key}: a {type(rec).__name__} record holds an integer grid, not GGML blocks; GGUF "
                             f"files hold GGML formats only (quantize with a GGML format, or export 'gptq' / "
                             f"'compressed-tensors')")


def _direct(keys: list, weights: dict, full: tuple) -> bool:
    return len(keys) == 1 and tuple(weights[keys[0]].shape) == tuple(full)


def row_places(model, params) -> dict:
    """Parameter -> where its rows land under checkpoint keys (:func:`jgptq_torch.checkpoint_keys.checkpoint_names`), for
    ``params`` (names) whose records are kept per checkpoint key."""
    if not params:
        return {}
    return checkpoint_keys.checkpoint_names(model, {param: checkpoint_keys.name_spec(model, param) for param in params})


def param_record(param: str, full: tuple, keys: list, weights: dict, places=None) -> GGMLWeight:
    """One :class:`GGMLWeight` covering parameter ``param`` of shape ``full`` from the records of its checkpoint
    ``keys`` (the record itself when one key holds it all; else stacked by ``places``, from :func:`row_places`)."""
    if _direct(keys, weights, full):
        return weights[keys[0]]
    if places is None:
        raise ValueError(f"{param}: its records {sorted(keys)[:4]} need the checkpoint places of its rows")
    return _stack(param, full, places, keys, weights)


def _stack(param: str, full: tuple, places: list, keys: list, weights: dict) -> GGMLWeight:
    found = {key for key, _, _ in places}
    if found != set(keys):
        raise ValueError(f"{param}: result.param_keys lists {sorted(keys)[:4]}, the checkpoint names of this "
                         f"parameter are {sorted(found)[:4]}")
    recs = [weights[k] for k in keys]
    formats = {r.format for r in recs}
    if len(formats) != 1:
        raise ValueError(f"{param}: its records use several formats {sorted(formats)}; one GGUF tensor holds one")
    first = recs[0]
    block = first.block_size
    if full[-1] % block:
        raise ValueError(f"{param}: rows of {full[-1]} values are not a multiple of the {first.format} block "
                         f"({block})")
    payload = np.zeros(full[:-1] + (full[-1] // block, first.payload.shape[-1]), np.uint8)
    covered = np.zeros(full[:-1], bool)
    for key, expert, rows in places:
        rec = weights[key]
        rows = np.asarray(rows)
        if expert is None and len(full) == 3:
            target = payload.reshape((-1,) + payload.shape[-2:])
            cov = covered.reshape(-1)
        elif expert is None:
            target, cov = payload, covered
        else:
            target, cov = payload[expert], covered[expert]
        expect = (len(rows), full[-1])
        got = tuple(rec.shape)
        if got != expect and not (expert is None and len(full) == 3 and got == full):
            raise ValueError(f"{key}: record shape {got} does not match its {expect[0]} rows of {param} {full}")
        target[rows] = rec.payload.reshape((len(rows),) + rec.payload.shape[-2:])
        cov[rows] = True
    if not covered.all():
        raise ValueError(f"{param}: the records of {sorted(keys)[:4]} do not cover every row")
    methods = {r.method for r in recs}
    return GGMLWeight(payload, first.format, method=methods.pop() if len(methods) == 1 else "mixed")


def format_weights(rec) -> tuple:
    """(GGML format, weights) of a record (:class:`GGMLWeight`)."""
    return rec.format, int(np.prod(rec.shape))


def count_formats(pairs) -> Counter:
    """Weights per GGML format of (format, weights) ``pairs`` (:func:`format_weights`), counted in their order."""
    formats = Counter()
    for fmt, weights in pairs:
        formats[fmt] += weights
    return formats


def record_formats(records) -> Counter:
    """Weights per GGML format of ``records`` (:class:`GGMLWeight`)."""
    return count_formats(map(format_weights, records))
