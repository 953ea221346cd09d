"""GPTQ (v1) checkpoints, as GPTQModel, vLLM and SGLang load them (transformers too, for dense models: its GPTQ
loader swaps nn.Linear modules only and skips the fused 3-D experts transformers 5 builds for MoE models).

Every quantized Linear ``<module>`` of out x in features is stored as

| tensor               | shape                       | dtype   | content                                            |
|----------------------|-----------------------------|---------|----------------------------------------------------|
| ``<module>.qweight`` | [ceil(in * bits / 32), out] | int32   | codes packed along the input axis                  |
| ``<module>.qzeros``  | [G, ceil(out * bits / 32)]  | int32   | zero points minus one, packed along the output axis |
| ``<module>.scales``  | [G, out]                    | float16 | grid scales                                        |
| ``<module>.g_idx``   | [in]                        | int32   | the group of every input column                    |
| ``<module>.bias``    | [out]                       | float16 | if the caller passes one                           |

with G = in / group_size (1 per channel) and the packing of :mod:`jgptq.export.packing` (input ``i`` of a
column at bit ``bits * i`` of its little-endian bit stream). Loaders compute
``W[o, i] = scales[g_idx[i], o] * (q[i, o] - (qzeros[g_idx[i], o] + 1))``. Storing ``z - 1`` is the legacy v1
convention every loader expects, so an asymmetric zero point of 0 cannot be stored: such weights are refused (use
``sym=True``, or the compressed-tensors exporter, which stores zero points as they are). Scales must already be
float16 values (solve with ``QuantConfig(scale_dtype="float16")``, the default), so the file decodes to exactly
the solver's weights. Loaders accept 2, 3, 4 and 8 bits.

``quantize_config.json`` and ``config.json["quantization_config"]`` carry ``bits``, ``group_size``, ``desc_act``
(True when some ``g_idx`` is not ``column // group_size``, so that loaders apply it), ``sym``, ``lm_head``,
``quant_method`` / ``checkpoint_format`` ``"gptq"``, ``pack_dtype`` ``"int32"`` and the solve's settings.

Example::

    from jgptq.export import QuantizedWeight, expert_entries, export_gptq_v1

    quantized = {"model.layers.0.self_attn.q_proj": QuantizedWeight.from_result(res_q, config)}
    quantized.update(expert_entries(QuantizedWeight.from_result(res_gate_up, config),
                     ["model.layers.0.mlp.experts.{expert}.gate_proj",
                      "model.layers.0.mlp.experts.{expert}.up_proj"]))
    export_gptq_v1("out/model-gptq", quantized, tensors=unquantized_state, model_config=hf_config_dict,
                   quant_config=config)

``quantized`` may also be an iterable of (name, record) pairs, consumed once (streamed to disk).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Mapping, Optional, Union

import numpy as np

from jgptq.export import packing
from jgptq.export.common import check_model_config, finish_config, iterate_entries, module_name, version_tag
from jgptq.export.pool import check_workers, ordered_results
from jgptq.export.records import QuantizedWeight
from jgptq.export.shards import DEFAULT_SHARD_BYTES, check_output_dir, write_checkpoint

GPTQ_BITS = (2, 3, 4, 8)

Entries = Union[Mapping[str, QuantizedWeight], Iterable[tuple[str, QuantizedWeight]]]


def gptq_tensors(name: str, record: QuantizedWeight) -> dict[str, np.ndarray]:
    """The GPTQ v1 tensors of one quantized Linear ``name`` (see the module docstring for shapes).

    Raises ValueError when the record cannot be stored faithfully (bits, zero point 0, non-float16 scales).
    """
    if record.codes.ndim != 2:
        raise ValueError(f"{name}: GPTQ stores 2-D weights; split expert stacks with expert_entries "
                         f"(got shape {record.shape})")
    if record.bits not in GPTQ_BITS:
        raise ValueError(f"{name}: GPTQ v1 loaders accept bits in {GPTQ_BITS}, got {record.bits}; use the "
                         f"compressed-tensors exporter for other widths")
    if not record.sym and np.any(record.zeros == 0):
        raise ValueError(f"{name}: asymmetric zero point 0 cannot be stored in GPTQ v1, which stores zero - 1; "
                         f"quantize with sym=True or write the compressed-tensors format (export_compressed_tensors)")
    scales16 = record.scales.astype(np.float16)
    if not np.all(scales16.astype(np.float32) == record.scales):
        raise ValueError(f"{name}: scales are not float16 values (GPTQ stores float16 scales); quantize with "
                         f"QuantConfig(scale_dtype='float16') so the checkpoint decodes to the solved weights")
    bits = record.bits
    return {
        f"{name}.qweight": np.ascontiguousarray(packing.pack_int32(record.codes.T, bits, axis=0)),
        f"{name}.qzeros": np.ascontiguousarray(packing.pack_int32(record.zeros.T.astype(np.int32) - 1, bits, axis=1)),
        f"{name}.scales": np.ascontiguousarray(scales16.T),
        f"{name}.g_idx": record.g_idx.astype(np.int32),
    }


def export_gptq_v1(out_dir, quantized: Entries, *, tensors: Optional[Entries] = None,
                   model_config: Mapping, quant_config=None, true_sequential: bool = True,
                   extra_files: Optional[Mapping[str, object]] = None,
                   max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                   workers: Optional[int] = None) -> dict:
    """Writes a GPTQ v1 checkpoint folder.

    Args:
      out_dir: output folder (refused if it exists and is not empty, unless ``overwrite``).
      quantized: module name (checkpoint naming, e.g. ``model.layers.0.mlp.experts.3.up_proj``; a trailing
        ``.weight`` is dropped) -> :class:`QuantizedWeight` (out, in); a mapping or (name, record) pairs. Every
        record must share bits, group_size and sym (one ``quantize_config`` describes them all).
      tensors: the unquantized tensors, name -> numpy array, written as given (embeddings, norms, routers,
        lm_head, ...), except the ``.bias`` of a quantized module, stored as float16 as GPTQ layers hold it.
      model_config: the model's ``config.json`` as a dict; written with ``quantization_config`` added.
      quant_config: the :class:`jgptq.QuantConfig` used (its damping, static groups and clip search are recorded;
        its bits, group_size and sym must match the records).
      true_sequential: recorded in the config (whether layers saw already-quantized inputs of their block).
      extra_files: more files for the folder (tokenizer, generation config): name -> bytes, str or path.
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
    seen = _Seen()
    quantized_modules: set[str] = set()

    def jobs():
        for raw, record in iterate_entries(quantized, "quantized"):
            if not isinstance(record, QuantizedWeight):
                raise ValueError(f"{raw}: expected a QuantizedWeight, got {type(record).__name__}")
            name = module_name(raw)
            seen.add(name, record)
            quantized_modules.add(name)
            yield functools.partial(gptq_tensors, name, record)

    def stream():
        for packed in ordered_results(jobs(), workers):
            yield from packed.items()
        for name, array in iterate_entries(tensors or {}, "tensors"):
            array = np.asarray(array)
            if name.endswith(".bias") and name[: -len(".bias")] in quantized_modules:
                array = _float16_bias(name, array)
            elif name.endswith(".weight") and name[: -len(".weight")] in quantized_modules:
                raise ValueError(f"{name}: the module is quantized; its dense weight cannot be written too")
            yield name, array

    memo: dict = {}

    def quantization_config() -> dict:  # called once every tensor was written
        if not memo:
            memo.update(gptq_quantization_config(seen, quant_config, true_sequential))
        return memo

    with contextlib.closing(stream()) as written:
        write_checkpoint(out_dir, written, json_files={
            "quantize_config.json": quantization_config,
            "config.json": lambda: finish_config(model_config, quantization_config()),
        }, extra_files=extra_files, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    return memo


class _Seen:
    """What the records written so far had in common (one quantize_config describes them all)."""

    def __init__(self):
        self.key = None
        self.first = None
        self.act_orders: set[str] = set()
        self.desc_act = False
        self.lm_head = False
        self.count = 0

    def add(self, name: str, record: QuantizedWeight):
        key = (record.bits, record.group_size, record.sym)
        if self.key is None:
            self.key, self.first = key, name
        elif key != self.key:
            raise ValueError(f"{name}: (bits, group_size, sym) = {key} differs from {self.key} of {self.first}; "
                             f"a GPTQ checkpoint describes every module with one quantize_config")
        self.act_orders.add(record.act_order)
        self.desc_act |= not record.has_plain_g_idx()
        self.lm_head |= name == "lm_head" or name.endswith(".lm_head")
        self.count += 1


def gptq_quantization_config(seen: _Seen, quant_config, true_sequential: bool) -> dict:
    """The ``quantize_config.json`` dict for the records seen (also ``config.json["quantization_config"]``)."""
    if seen.key is None:
        raise ValueError("no quantized modules were given")
    bits, group_size, sym = seen.key
    if quant_config is not None and (quant_config.bits, quant_config.group_size, quant_config.sym) != seen.key:
        raise ValueError(f"quant_config (bits, group_size, sym) = "
                         f"{(quant_config.bits, quant_config.group_size, quant_config.sym)} differs from the "
                         f"records' {seen.key}")
    act_order = quant_config.act_order if quant_config is not None else "/".join(sorted(seen.act_orders))
    meta = {"quantizer": [version_tag()], "act_order": act_order, "modules": seen.count}
    if quant_config is not None:
        meta.update(mse=quant_config.mse, scale_dtype=quant_config.scale_dtype)
    return {
        "bits": bits,
        "group_size": group_size,
        "desc_act": seen.desc_act,
        "sym": sym,
        "lm_head": seen.lm_head,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "format": "gptq",
        "pack_dtype": "int32",
        "damp_percent": float(quant_config.damp) if quant_config is not None else 0.01,
        "static_groups": bool(quant_config.static_groups or quant_config.act_order == "static")
        if quant_config is not None else False,
        "true_sequential": bool(true_sequential),
        "act_group_aware": seen.act_orders == {"group_aware"},
        "meta": meta,
    }


def _float16_bias(name: str, array: np.ndarray) -> np.ndarray:
    if array.ndim != 1 or array.dtype.kind != "f":
        raise ValueError(f"{name}: a bias must be a 1-D float array, got {array.dtype} {array.shape}")
    out = array.astype(np.float16)
    if not np.all(np.isfinite(out[np.isfinite(array)])):
        raise ValueError(f"{name}: values overflow float16 (GPTQ layers hold float16 biases)")
    return out
