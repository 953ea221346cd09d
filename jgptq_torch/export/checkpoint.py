"""A quantized transformers model as a checkpoint folder that serving stacks load: :func:`export_model`.

Usage::

    result = jgptq.quantize_moe(model, texts, tokenizer=tok, bits=4, group_size=128,
                                scale_dtype="bfloat16")              # the model dtype, for compressed-tensors
    export_model(model, result, "compressed-tensors", "out/model-w4g128", tokenizer=tok)

Kinds:

- ``"gptq"``: GPTQ v1 (``qweight``/``qzeros``/``scales``/``g_idx``, :func:`jgptq.export.export_gptq_v1`);
- ``"compressed-tensors"``: ``pack-quantized`` (:func:`jgptq.export.export_compressed_tensors`);
- ``"gguf"``: a GGUF file, by ``jgptq_torch.export.gguf.export.export_gguf(model, result, out, overwrite=..., **options)``
  (a separate module, given ``tokenizer=`` / ``source_dir=`` when it takes them; an error says so when it is not
  installed).

The folder holds what ``save_pretrained`` would write, with the quantized weights in the chosen format: every
other tensor of the model (embeddings, norms, routers, lm_head, biases, persistent buffers) under its checkpoint
name (fused experts reverted to per-expert names by transformers' own conversion; tied weights written once),
``config.json`` (the model's config with ``quantization_config``), ``generation_config.json`` and the tokenizer
files when there are any. Tensors are written to sharded safetensors with an index, atomically: an error leaves
the output path as it was.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from jgptq_torch import checkpoint_keys
from jgptq_torch.gpu_sharing import share_gpu_with_torch
from jgptq.export import export_compressed_tensors, export_gptq_v1
from jgptq.export.shards import DEFAULT_SHARD_BYTES, check_output_dir

KINDS = ("gptq", "compressed-tensors", "gguf")
GPTQ_BITS = (2, 3, 4, 8)
# Files of a model folder that belong to its tokenizer or processor (copied as they are).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json")


class ExportError(ValueError):
    """The result cannot be written in the requested format (the message says why and what to do)."""


def gguf_available() -> bool:
    """True when the GGUF exporter module (``jgptq_torch.export.gguf.export``) is installed."""
    return importlib.util.find_spec("jgptq_torch.export.gguf.export") is not None


def check_format(kind: str, quant) -> None:
    """Refuses, before any work, a :class:`jgptq.config.QuantConfig` that exporter ``kind`` cannot hold.

    Raises:
      ExportError: unknown kind; a GGML format for an integer-grid exporter or an integer grid for GGUF; bits the
        GPTQ v1 loaders do not read; a ``desc`` act-order with groups for compressed-tensors; the GGUF exporter
        missing.
    """
    if kind not in KINDS:
        raise ExportError(f"unknown export kind {kind!r}; choose one of {KINDS}")
    if kind == "gguf":
        if not gguf_available():
            raise ExportError("export 'gguf' needs the module jgptq_torch.export.gguf.export (export_gguf), which is not "
                              "installed in this jgptq; export 'gptq' or 'compressed-tensors' instead")
        if quant is not None and not quant.is_ggml:
            raise ExportError(f"GGUF export needs a GGML format, not {quant.format!r} (integer grids): pass "
                              f"--format q4_k (or another GGML format) or --mix q4_k_m (format=/mix= in Python); "
                              f"integer grids export as 'gptq' or 'compressed-tensors'")
        return
    if quant.is_ggml:
        raise ExportError(f"format {quant.format!r} is a GGML block format; the {kind} exporter holds integer grids "
                          f"only (format 'int'); write GGML formats with export 'gguf'")
    if kind == "gptq" and quant.bits not in GPTQ_BITS:
        raise ExportError(f"GPTQ v1 loaders read bits {GPTQ_BITS}, not {quant.bits}; choose one of them or "
                          f"export 'compressed-tensors' (any width 2..8)")
    if kind == "compressed-tensors" and quant.act_order == "desc" and quant.group_size != -1:
        raise ExportError("act_order 'desc' with groups gives a non-monotonic g_idx, which compressed-tensors "
                          "pack-quantized cannot hold; use act_order 'static' or 'group_aware', or export 'gptq'")


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def checkpoint_state(model, result=None, *, revert: bool = True, state=None) -> dict:
    """The tensors ``save_pretrained`` writes for ``model``, under checkpoint names, without the quantized ones.

    Args:
      model: a transformers model.
      result: an :class:`jgptq_torch.report.QuantizeResult`; its quantized parameters are left out.
      revert: False keeps the model's own parameter names (``names="modules"``) instead of the checkpoint names.
      state: the model's ``state_dict`` to use instead of ``model.state_dict()`` (a streamed model's tensors,
        gathered from where they are).
    Returns:
      checkpoint key -> torch tensor (on the model's devices; tied weights once; fused experts per expert).
    """
    state = model.state_dict() if state is None else dict(state)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    quantized = set(result.weights) if result is not None else set()
    if result is not None:
        for param in getattr(result, "param_keys", {}) or {}:
            state.pop(param, None)  # reverted below, the fused parameter would be copied per expert for nothing
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        state = remove_tied_weights_from_state_dict(state, model)
    except ImportError:  # an older transformers: drop later names of shared storage
        seen = set()
        for key in list(state):
            ptr = (state[key].untyped_storage().data_ptr(), state[key].storage_offset())
            if ptr in seen:
                del state[key]
            seen.add(ptr)
    if revert:
        try:
            from transformers.core_model_loading import revert_weight_conversion

            state = revert_weight_conversion(model, state)
        except ImportError:
            pass
    return {k: v for k, v in state.items() if k not in quantized}


def _ignore_list(model, state: dict) -> list:
    """Modules a compressed-tensors loader must leave in floating point: lm_head and every module with an
    unquantized 2-D weight that is not an embedding (routers, excluded modules)."""
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    ignore = {"lm_head"}
    for key, t in state.items():
        if key.endswith(".weight") and t.ndim == 2 and key not in embeddings:
            ignore.add(key[: -len(".weight")])
    return sorted(ignore)


def model_config_dict(model) -> dict:
    """The model's ``config.json`` contents as ``save_pretrained`` writes them (dtype and architectures set)."""
    cfg = model.config.to_diff_dict()  # what save_pretrained writes: no local paths, defaults left out
    cfg.pop("quantization_config", None)
    cfg["dtype"] = str(model.dtype).split(".")[-1]
    cfg["architectures"] = [type(model).__name__]
    return cfg


def _extra_files(model, tokenizer, source_dir, scratch: Path) -> dict:
    files: dict = {}
    src = Path(source_dir) if source_dir is not None else None
    if src is not None and (src / "generation_config.json").is_file():
        files["generation_config.json"] = src / "generation_config.json"
    elif getattr(model, "generation_config", None) is not None and model.can_generate():
        files["generation_config.json"] = model.generation_config.to_json_string(use_diff=True)
    copied = [src / f for f in TOKENIZER_FILES if src is not None and (src / f).is_file()]
    if copied:
        files.update({p.name: p for p in copied})
    elif tokenizer is not None:
        for name in tokenizer.save_pretrained(str(scratch)):
            p = Path(name)
            if p.is_file() and p.name not in files:
                files[p.name] = p
    return files


def fused_experts(model, result) -> dict:
    """The fused 3-D expert parameters of ``model`` that ``result`` quantized, with their checkpoint keys.

    Returns:
      parameter name (e.g. ``model.layers.0.mlp.experts.gate_up_proj``) -> the per-expert checkpoint keys its
      rows were written under (``...experts.3.gate_proj.weight``; Mixtral ``...block_sparse_moe.experts.3.w1.weight``).
    """
    fused = {}
    for param, keys in (getattr(result, "param_keys", None) or {}).items():
        try:
            tensor = model.get_parameter(param)
        except AttributeError:
            continue
        if tensor.ndim == 3:
            fused[param] = list(keys)
    return fused


_PROJECTION = {"down_proj": "down_proj", "gate_up_proj": "gate_proj"}


def _named_like_modules(param: str, keys) -> bool:
    """True when the checkpoint keys of fused ``param`` are the per-expert module names a defusing loader builds
    (``<experts>.<e>.gate_proj`` / ``up_proj`` / ``down_proj``), as GPTQModel looks them up."""
    prefix = param.rpartition(".")[0] + "."
    projections = (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")
    return all(k.startswith(prefix) and k.endswith(projections) for k in keys)


NAMES = ("checkpoint", "modules")


def module_keys(model, result) -> dict:
    """Checkpoint key -> module key of every quantized weight of ``result``, for ``names="modules"``.

    A module key is the weight's name among the model's modules as a defusing loader builds them: a 2-D weight
    keeps its parameter name; each expert of a fused 3-D parameter ``<experts>.gate_up_proj`` becomes
    ``<experts>.<e>.gate_proj.weight`` (the first half of its rows) and ``<experts>.<e>.up_proj.weight`` (the
    second half), and of ``<experts>.down_proj`` ``<experts>.<e>.down_proj.weight``. GPTQModel looks experts up by
    these names; for Qwen3-MoE and OLMoE they equal the checkpoint names, for Mixtral they do not
    (``block_sparse_moe.experts.<e>.w1``).

    Raises:
      ExportError: a parameter whose records do not map onto whole modules.
    """
    keys_of = dict(getattr(result, "param_keys", None) or {k: [k] for k in result.weights})
    spec, out = {}, {}
    for param, keys in keys_of.items():
        tensor = model.get_parameter(param)
        if tensor.ndim == 2:
            if len(keys) != 1:
                raise ExportError(f"{param}: its rows were written as {len(keys)} checkpoint tensors "
                                  f"({sorted(keys)[:2]}...); names='modules' needs one record per module")
            out[keys[0]] = param
            continue
        spec[param] = checkpoint_keys.name_spec(model, param)
    places = checkpoint_keys.checkpoint_names(model, spec) if spec else {}
    for param, entries in places.items():
        experts_path, _, fused = param.rpartition(".")
        rows = spec[param][1]
        halves = {"gate_proj": list(range(rows // 2)), "up_proj": list(range(rows // 2, rows))}
        for key, expert, idx in entries:
            idx = idx.tolist()
            if fused == "gate_up_proj":
                proj = next((name for name, want in halves.items() if idx == want), None)
            else:
                proj = fused if idx == list(range(rows)) else None
            if expert is None or proj is None:
                raise ExportError(f"{param}: checkpoint tensor {key} holds rows that are not one expert's whole "
                                  f"projection; names='modules' cannot name it")
            out[key] = f"{experts_path}.{expert}.{proj}.weight"
    return out


def loader_warnings(model, result, kind: str, names: str = "checkpoint") -> list:
    """What the loaders we name would get wrong with this export, as one message each (empty: none).

    - GPTQ v1 of a model whose experts transformers fuses (3-D ``gate_up_proj`` / ``down_proj``): transformers'
      GPTQ loader (optimum + gptqmodel) replaces ``nn.Linear`` modules only, so it leaves those experts randomly
      initialized, without an error. GPTQModel.load defuses them and reads the per-expert modules, when the
      checkpoint names are its module names (Qwen3-MoE, OLMoE, ...; not Mixtral's ``block_sparse_moe.*.w1``).
    - compressed-tensors with asymmetric grids: transformers fails on the packed zero points unless loaded with
      ``CompressedTensorsConfig(dequantize=True)``, and on fused experts' zero points even then.
    """
    quant = result.config.quant if getattr(result, "config", None) is not None else None
    fused = fused_experts(model, result)
    name = type(model).__name__
    messages = []
    if kind == "gptq" and fused:
        param = min(fused)
        keys = fused[param]
        loaders = "GPTQModel.load and vLLM"
        like_modules = all(_named_like_modules(p, k) for p, k in fused.items())
        if names == "modules" and not like_modules:
            loaders = (f"GPTQModel.load (it holds the experts under module names, {param.rpartition('.')[0]}.0."
                       f"{_PROJECTION.get(param.rpartition('.')[2], 'gate_proj')}; vLLM reads this family under "
                       f"its checkpoint names, names='checkpoint', {sorted(keys)[0][: -len('.weight')]})")
        elif not like_modules:
            experts, _, fused_name = param.rpartition(".")
            wanted = f"{experts}.0.{_PROJECTION.get(fused_name, 'gate_proj')}"
            loaders = (f"vLLM (GPTQModel.load 7.7 refuses it: it looks the experts up as {wanted}, not as "
                       f"{sorted(keys)[0][: -len('.weight')]}; export with names='modules' for it)")
        messages.append(
            f"{name} keeps its experts fused ({param}): transformers' GPTQ loader reads only nn.Linear modules and "
            f"would leave these experts randomly initialized, without an error. This GPTQ v1 checkpoint loads with "
            f"{loaders}; for transformers, export 'compressed-tensors' with symmetric grids")
    if kind == "compressed-tensors" and quant is not None and not quant.sym:
        moe = ", and fails on the fused experts' zero points even with it" if fused else ""
        messages.append(
            f"asymmetric grids: transformers loads this compressed-tensors checkpoint only with "
            f"quantization_config=CompressedTensorsConfig(dequantize=True) (without it, loading fails on the packed "
            f"zero points){moe}; symmetric grids (sym=True) load either way")
    return messages


def export_model(model, result, kind: str, out_dir, *, overwrite: bool = False, tokenizer=None,
                 source_dir=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES, names: str = "checkpoint",
                 verify: bool = True, **options) -> Path:
    """Writes ``model`` quantized by ``result`` as a checkpoint folder (or GGUF file) of ``kind``.

    Args:
      model: the transformers model that :func:`jgptq.quantize_moe` quantized (its unquantized tensors are read).
      result: the :class:`jgptq_torch.report.QuantizeResult` of that run (records by checkpoint key).
      kind: ``"gptq"``, ``"compressed-tensors"`` or ``"gguf"``.
      out_dir: the folder to write (a GGUF exporter may take a file path).
      overwrite: replace an existing non-empty folder (whole, once the new one is complete).
      tokenizer: its files are saved into the folder (unless ``source_dir`` has tokenizer files).
      source_dir: the model's folder: its tokenizer files and ``generation_config.json`` are copied as they are.
      max_shard_bytes: most tensor bytes per safetensors file.
      names: ``"checkpoint"`` (default): tensors under the names ``save_pretrained`` writes, which transformers
        and vLLM read; ``"modules"`` (``"gptq"`` only): under the model's module names with fused experts split
        per expert (:func:`module_keys`), which GPTQModel.load needs where the two differ (Mixtral).
      verify: read a GPTQ or compressed-tensors checkpoint back once written and decode every quantized module
        from its stored tensors alone (:func:`jgptq_torch.export.read_back.check_written`); any module that does not
        decode exactly to the solver's weight raises. A GGUF file is read back with the ``gguf`` package before it
        is put in place, every tensor compared byte for byte with the records' blocks (``write_gguf``).
      **options: passed on to the exporter (e.g. ``group_actorder=True`` for compressed-tensors).
    Returns:
      The output path.
    Raises:
      ExportError: the result holds something the format cannot (see :func:`check_format`; fused 3-D expert
        tensors that a checkpoint of this family keeps fused); a written checkpoint that does not read back to
        the solver's weights (``verify``); FileExistsError: a non-empty output without ``overwrite``.
    """
    share_gpu_with_torch()
    quant = result.config.quant if getattr(result, "config", None) is not None else None
    if quant is not None:
        check_format(kind, quant)
    elif kind not in KINDS:
        raise ExportError(f"unknown export kind {kind!r}; choose one of {KINDS}")
    if names not in NAMES:
        raise ExportError(f"unknown names {names!r}; choose one of {NAMES}")
    if names != "checkpoint" and kind != "gptq":
        raise ExportError(f"names={names!r} is for 'gptq' exports (GPTQModel.load); {kind} checkpoints keep the "
                          f"checkpoint names their loaders read")
    if kind == "gguf":
        if not gguf_available():
            check_format(kind, None)
        from jgptq_torch.export.gguf.export import export_gguf

        accepted = inspect.signature(export_gguf).parameters
        anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        for name, value in (("tokenizer", tokenizer), ("source_dir", source_dir)):
            if value is not None and (anything or name in accepted):
                options[name] = value
        return export_gguf(model, result, out_dir, overwrite=overwrite, verify=verify, **options)
    out = check_output_dir(out_dir, overwrite)
    if not result.weights:
        raise ExportError("the result holds no quantized weights")
    for key, rec in result.weights.items():
        if rec.codes.ndim != 2:
            raise ExportError(f"{key}: {type(model).__name__} checkpoints keep every expert in one fused tensor "
                              f"{rec.shape}; the {kind} format holds 2-D per-module weights only, so this model "
                              f"cannot be exported to it")
    for message in loader_warnings(model, result, kind, names):
        warnings.warn(message, stacklevel=2)
    weights = result.weights
    if names == "modules":
        renamed = module_keys(model, result)
        weights = {renamed[k]: rec for k, rec in weights.items()}
    state = checkpoint_state(model, result, revert=names == "checkpoint")
    tensors = ((k, _numpy(v)) for k, v in state.items())
    model_config = model_config_dict(model)
    scratch = Path(tempfile.mkdtemp(prefix="jgptq-export-"))
    try:
        extra = _extra_files(model, tokenizer, source_dir, scratch)
        if kind == "gptq":
            export_gptq_v1(out, weights, tensors=tensors, model_config=model_config, quant_config=quant,
                           extra_files=extra, max_shard_bytes=max_shard_bytes, overwrite=overwrite, **options)
        else:
            export_compressed_tensors(out, result.weights, tensors=tensors, model_config=model_config,
                                      ignore=_ignore_list(model, state), quant_config=quant, extra_files=extra,
                                      max_shard_bytes=max_shard_bytes, overwrite=overwrite, **options)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if verify:
        from jgptq_torch.export.read_back import check_written

        problems = check_written(out, kind, weights)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ExportError(f"{out}: the written {kind} checkpoint does not decode to the solver's weights: "
                              f"{'; '.join(problems[:5])}{more}. The folder is left as written, for inspection")
    return Path(os.fspath(out))
