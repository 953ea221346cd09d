"""compressed-tensors ``pack-quantized`` checkpoints, as vLLM (Marlin / Machete kernels) and transformers load them.

Every quantized Linear ``<module>`` of out x in features is stored as

| tensor                         | shape                      | dtype         | when                            |
|--------------------------------|----------------------------|---------------|---------------------------------|
| ``<module>.weight_packed``     | [out, ceil(in * bits / 32)]| int32         | always                          |
| ``<module>.weight_scale``      | [out, G]                   | scale dtype   | always                          |
| ``<module>.weight_shape``      | [2] = (out, in)            | int64         | always                          |
| ``<module>.weight_zero_point`` | [ceil(out * bits / 32), G] | int32         | asymmetric grids only           |
| ``<module>.weight_g_idx``      | [in]                       | int32         | ``group_actorder=True`` only    |

G = in / group_size ("group" strategy) or 1 ("channel"). compressed-tensors quantizes to signed integers
``q in [-2**(bits-1), 2**(bits-1) - 1]`` with ``W = scale * (q - zero_point)``; jgptq's unsigned codes ``c`` and
zero points ``z`` are the same grid shifted by ``2**(bits-1)`` (``q = c - 2**(bits-1)``; a symmetric grid has
``z = 2**(bits-1)``, i.e. the format's zero point 0, and stores none). The packer adds ``2**(bits-1)`` back before
packing, so ``weight_packed`` is the codes packed along the input axis and ``weight_zero_point`` the zero points
packed along the output axis (:mod:`jgptq.export.packing`). Zero points are stored as they are, so asymmetric
grids of any zero point work here (unlike GPTQ v1).

Act-order: ``static`` and ``group_aware`` solves (and ``desc`` per channel) keep ``g_idx = column // group_size``,
which this format assumes; the config then says ``actorder: "weight"`` (columns reordered during calibration
only). A ``desc`` solve with groups has a non-monotonic ``g_idx``; compressed-tensors 0.20 removed the
``actorder: "group"`` layout that stored it, so such weights are refused unless ``group_actorder=True``, which
writes that legacy layout (``weight_g_idx`` for every module) for loaders built on older compressed-tensors.
Use ``act_order="static"`` or ``"group_aware"`` for checkpoints current loaders read, or the GPTQ v1 exporter.

``config.json["quantization_config"]``::

    {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 128,
                    "actorder": "weight", "observer": "minmax", "dynamic": false}}},
     "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": null, ...}

``targets: ["Linear"]`` applies the scheme to every Linear layer not in ``ignore``: list there every Linear layer
left unquantized (lm_head, MoE routers, ...). Scales are stored in ``scale_dtype`` (default: the records'). Loaders
dequantize in the scale dtype (transformers) or cast scales to the model dtype (vLLM), so solve with
``QuantConfig(scale_dtype=<the model dtype>)``; a mismatch is warned about.

Example::

    from jgptq.export import QuantizedWeight, export_compressed_tensors

    export_compressed_tensors("out/model-w4a16", quantized, tensors=unquantized_state, model_config=cfg,
                              ignore=["lm_head", "re:.*mlp.gate$"])
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from jgptq.export import packing
from jgptq.export.common import check_model_config, finish_config, iterate_entries, module_name, version_tag
from jgptq.export.pool import check_workers, ordered_results
from jgptq.export.records import SCALE_DTYPES, QuantizedWeight, storage_dtype
from jgptq.export.shards import DEFAULT_SHARD_BYTES, check_output_dir, write_checkpoint

Entries = Union[Mapping[str, QuantizedWeight], Iterable[tuple[str, QuantizedWeight]]]


def compressed_tensors(name: str, record: QuantizedWeight, scale_dtype: str,
                       group_actorder: bool = False) -> dict[str, np.ndarray]:
    """The pack-quantized tensors of one quantized Linear ``name`` (see the module docstring for shapes).

    Raises ValueError for a record the format cannot hold exactly (non-monotonic g_idx without
    ``group_actorder``, scales not representable in ``scale_dtype``).
    """
    if record.codes.ndim != 2:
        raise ValueError(f"{name}: pack-quantized stores 2-D weights here; split expert stacks with "
                         f"expert_entries (got shape {record.shape})")
    if not group_actorder and not record.has_plain_g_idx():
        raise ValueError(f"{name}: g_idx is not column // group_size (a 'desc' act-order solve with groups); "
                         f"compressed-tensors pack-quantized has no g_idx since 0.20. Quantize with act_order "
                         f"'static' or 'group_aware', use the GPTQ v1 exporter, or pass group_actorder=True for "
                         f"the legacy actorder='group' layout of older loaders")
    dtype = storage_dtype(scale_dtype)
    scales = record.scales.astype(dtype)
    if not np.all(scales.astype(np.float32) == record.scales):
        raise ValueError(f"{name}: scales are not exactly representable in {scale_dtype}; quantize with "
                         f"QuantConfig(scale_dtype={scale_dtype!r}) or export with the records' scale dtype")
    out = {
        f"{name}.weight_packed": packing.pack_int32(record.codes, record.bits, axis=1),
        f"{name}.weight_scale": scales,
        f"{name}.weight_shape": np.asarray(record.shape, np.int64),
    }
    if not record.sym:
        out[f"{name}.weight_zero_point"] = packing.pack_int32(record.zeros, record.bits, axis=0)
    if group_actorder:
        out[f"{name}.weight_g_idx"] = record.g_idx.astype(np.int32)
    return out


def export_compressed_tensors(out_dir, quantized: Entries, *, tensors: Optional[Entries] = None,
                              model_config: Mapping, ignore: Sequence[str] = ("lm_head",),
                              scale_dtype: Optional[str] = None, quant_config=None, group_actorder: bool = False,
                              extra_files: Optional[Mapping[str, object]] = None,
                              max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                              workers: Optional[int] = None) -> dict:
    """Writes a compressed-tensors ``pack-quantized`` checkpoint folder.

    Args:
      out_dir: output folder (refused if it exists and is not empty, unless ``overwrite``).
      quantized: module name (checkpoint naming; a trailing ``.weight`` is dropped) -> :class:`QuantizedWeight`
        (out, in); a mapping or (name, record) pairs. Records must share bits, group_size and sym (one scheme).
      tensors: the unquantized tensors, name -> numpy array, written as given.
      model_config: the model's ``config.json`` as a dict; written with ``quantization_config`` added.
      ignore: Linear layers left unquantized (names or ``"re:"`` patterns), e.g. ``["lm_head",
        "re:.*mlp.gate$"]``; a quantized module matching one is an error.
      scale_dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``; default: the records' ``scale_dtype``.
      quant_config: the :class:`jgptq.QuantConfig` used (its clip search names the observer; its bits,
        group_size and sym must match the records).
      group_actorder: write the legacy ``actorder: "group"`` layout with ``weight_g_idx`` (see module docs).
      extra_files: more files for the folder: name -> bytes, str or path.
      max_shard_bytes: most tensor bytes per safetensors file.
      overwrite: replace an existing non-empty folder.
      workers: threads packing records ahead of the writer, in order (None: :func:`jgptq.export.pool.default_workers`;
        1: one at a time in the calling thread). The bytes written are the same for any number.
    Returns:
      The ``quantization_config`` dict written.
    """
    check_output_dir(out_dir, overwrite)
    check_model_config(model_config)
    workers = check_workers(workers)
    if scale_dtype is not None and scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r} must be one of {SCALE_DTYPES}")
    ignore = list(ignore)
    patterns = [re.compile(p[3:]) for p in ignore if p.startswith("re:")]
    state = {"key": None, "first": None, "act_orders": set(), "scale_dtype": scale_dtype, "count": 0}
    quantized_modules: set[str] = set()

    def jobs():
        for raw, record in iterate_entries(quantized, "quantized"):
            if not isinstance(record, QuantizedWeight):
                raise ValueError(f"{raw}: expected a QuantizedWeight, got {type(record).__name__}")
            name = module_name(raw)
            if name in ignore or any(p.match(name) for p in patterns):
                raise ValueError(f"{name}: quantized, but listed in ignore {ignore}")
            key = (record.bits, record.group_size, record.sym)
            if state["key"] is None:
                state["key"], state["first"] = key, name
                state["scale_dtype"] = state["scale_dtype"] or record.scale_dtype
            elif key != state["key"]:
                raise ValueError(f"{name}: (bits, group_size, sym) = {key} differs from {state['key']} of "
                                 f"{state['first']}; this exporter writes one quantization scheme")
            state["act_orders"].add(record.act_order)
            state["count"] += 1
            quantized_modules.add(name)
            yield functools.partial(compressed_tensors, name, record, state["scale_dtype"], group_actorder)

    def stream():
        for packed in ordered_results(jobs(), workers):
            yield from packed.items()
        for name, array in iterate_entries(tensors or {}, "tensors"):
            if name.endswith(".weight") and name[: -len(".weight")] in quantized_modules:
                raise ValueError(f"{name}: the module is quantized; its dense weight cannot be written too")
            yield name, np.asarray(array)

    memo: dict = {}

    def quantization_config() -> dict:
        if not memo:
            memo.update(ct_quantization_config(state, ignore, quant_config, group_actorder))
        return memo

    with contextlib.closing(stream()) as written:
        write_checkpoint(out_dir, written,
                         json_files={"config.json": lambda: finish_config(model_config, quantization_config())},
                         extra_files=extra_files, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    _warn_on_dtype(model_config, state["scale_dtype"])
    return memo


def ct_quantization_config(state: dict, ignore: list, quant_config, group_actorder: bool) -> dict:
    """The ``quantization_config`` dict of a pack-quantized checkpoint (see the module docstring)."""
    if state["key"] is None:
        raise ValueError("no quantized modules were given")
    bits, group_size, sym = state["key"]
    if quant_config is not None and (quant_config.bits, quant_config.group_size, quant_config.sym) != state["key"]:
        raise ValueError(f"quant_config (bits, group_size, sym) = "
                         f"{(quant_config.bits, quant_config.group_size, quant_config.sym)} differs from the "
                         f"records' {state['key']}")
    grouped = group_size != -1
    if group_actorder:
        actorder = "group"
    elif grouped and state["act_orders"] - {"none"}:
        actorder = "weight"
    else:
        actorder = None
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": sym,
        "strategy": "group" if grouped else "channel",
        "group_size": group_size if grouped else None,
        "actorder": actorder,
        "observer": "mse" if quant_config is not None and quant_config.mse > 0 else "minmax",
        "dynamic": False,
    }
    if not sym:
        weights["zp_dtype"] = "torch.int8"
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "producer": {"name": version_tag(), "modules": state["count"],
                     "act_order": "/".join(sorted(state["act_orders"]))},
    }


def _warn_on_dtype(model_config: Mapping, scale_dtype: str) -> None:
    model_dtype = model_config.get("dtype", model_config.get("torch_dtype"))
    if isinstance(model_dtype, str) and model_dtype in SCALE_DTYPES and model_dtype != scale_dtype:
        warnings.warn(f"scales were written as {scale_dtype} but the model dtype is {model_dtype}; loaders "
                      f"dequantize in the scale dtype or cast scales to the model dtype, so the loaded weights "
                      f"can differ from the solved ones (quantize with QuantConfig(scale_dtype={model_dtype!r}) "
                      f"for an exact checkpoint)", stacklevel=3)
