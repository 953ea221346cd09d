"""GGUF files of transformers models that llama.cpp loads: float, or carrying jgptq's GGML blocks byte for byte.

- :func:`export_gguf`: the model (``result=None``: every weight in a float type) or a quantization result whose
  :class:`jgptq.export.GGMLWeight` records are written as they are (no re-encoding), with the metadata llama.cpp
  reads for the architecture. Norms and routers stay float32; the embedding and the output head get llama.cpp's
  types for the run (:func:`jgptq.plan.edge_formats`), or stay in ``float_type`` (``float_embeddings=True``, or
  a result without a GGML config) unless the result holds records for them.
- :func:`gguf_names`: model parameter name -> GGUF tensor names (:mod:`jgptq_torch.export.gguf.arch`).
- :func:`export_imatrix`: an importance statistic keyed by parameter name, written as a llama.cpp imatrix file
  under the GGUF tensor names (``llama-quantize --imatrix``).

Example::

    result = jgptq.quantize_moe(model, calib, QuantConfig(format="q4_k"))
    export_gguf(model, result, "model-q4_k.gguf")
    export_gguf(model, None, "model-f32.gguf", float_type="f32")   # llama.cpp's quantizer input
"""

from __future__ import annotations

from jgptq.surface import option

import functools
import os
import re
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch

from jgptq_torch import models
from jgptq_torch.gpu_sharing import share_gpu_with_torch
from jgptq_torch.export.gguf.arch import (ARCHITECTURES, Target, UnsupportedGGUFModel, arch_of, gguf_names, metadata,
                               qk_row_order, rope_freqs, targets)
from jgptq_torch.export.gguf.edges import edge_records
from jgptq_torch.export.gguf.records import assemble, record_formats
from jgptq_torch.export.gguf.vocab import vocab_metadata
from jgptq.export.gguf import FLOAT_TYPES, GGUFTensor, write_gguf
from jgptq.export.records import GGMLWeight

__all__ = ["export_gguf", "export_imatrix", "check_exportable", "gguf_names", "ARCHITECTURES", "UnsupportedGGUFModel"]

QUANTIZATION_VERSION = 2
# roles of the tensors written in float32 whatever float_type says (llama.cpp's converter writes every bias and
# router in F32; norms and other vectors are F32 for llama.cpp's kernels)
_FLOAT32_ROLES = ("norm", "router", "bias")
# ``general.file_type`` is llama.cpp's LLAMA_FTYPE of the run. A GGML format alone maps to the llama.cpp type of
# the same name; q3_k, q4_k and q5_k have no plain type, only _S/_M/_L mixes, and _S is the one whose tensors all
# stay in the base format but for a few early layers. A mix preset maps to the llama.cpp type it reproduces.
_PLAIN_K_FILE_TYPES = {"q3_k": "MOSTLY_Q3_K_S", "q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S"}
_FLOAT_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16"}


def _file_type(formats: Counter, float_type: str, mix: str | None = None) -> int:
    """llama.cpp's LLAMA_FTYPE (int): of ``mix`` when given, else of the dominant GGML format, else of the float
    type; ``GUESSED`` (1024) for a format llama.cpp has no file type for."""
    if mix is not None:
        name = "MOSTLY_" + mix.upper()
    elif not formats:
        name = _FLOAT_FILE_TYPES[float_type]
    else:
        main = formats.most_common(1)[0][0]
        name = _PLAIN_K_FILE_TYPES.get(main, "MOSTLY_" + main.upper())
    member = getattr(gguf.LlamaFileType, name, None)
    return (gguf.LlamaFileType.GUESSED if member is None else member).value


def _model_name(model) -> str:
    """``general.name``: the basename of the folder or hub id the config was loaded from, else the class name."""
    source = str(getattr(model.config, "_name_or_path", "") or "").rstrip("/\\")
    return Path(source).name or type(model).__name__


def _linear_view(model, param: str, tensor: torch.Tensor) -> np.ndarray:
    """float32 numpy of a parameter in nn.Linear orientation (..., out, in)."""
    owner = param.rpartition(".")[0]
    t = tensor.detach().to("cpu", torch.float32)
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        module = None
    if module is not None and models.is_experts_module(module) and t.ndim == 3:  # a weight stack, not its bias
        t = models.ExpertsLayout.of(module).linear(t)
    return t.contiguous().numpy()


def check_exportable(model, tokenizer=None) -> None:
    """Refuses, before any quantization work, a model or tokenizer :func:`export_gguf` would refuse afterwards.

    Raises:
      UnsupportedGGUFModel: an unsupported family or setting; NotImplementedError: an unsupported tokenizer.
    """
    arch_of(model)
    targets(model, arch_of(model))
    if tokenizer is not None:
        vocab_metadata(tokenizer, int(model.config.vocab_size))


def _payload_rows(rec: GGMLWeight, t) -> np.ndarray:
    """The blocks of the rows a GGUF tensor takes from a record, permuted for llama.cpp's RoPE where needed."""
    data = rec.payload if t.rows is None else rec.payload[..., t.rows, :, :]
    return data[qk_row_order(t.heads, data.shape[-3])] if t.heads else data


def _float_rows(model, param: str, tensor: torch.Tensor, t) -> np.ndarray:
    """float32 rows of a parameter a GGUF tensor takes (nn.Linear orientation, RoPE-permuted where needed)."""
    value = _linear_view(model, param, tensor)
    if t.split is not None:
        return np.ascontiguousarray(t.split.floats(value))
    if t.rows is None:
        data = value
    else:                # a bias's entries are its last axis, a weight's rows the one before
        data = value[..., t.rows] if t.role == "bias" else value[..., t.rows, :]
    if t.heads:  # rows of a weight, entries of a bias
        data = data[qk_row_order(t.heads, data.shape[-2] if data.ndim > 1 else data.shape[0])]
    return np.ascontiguousarray(data.reshape(-1) if t.flat else data)


def _split_blocks(rec: GGMLWeight, t) -> np.ndarray:
    return np.ascontiguousarray(t.split.blocks(rec.payload))


def _split_dequantized(rec: GGMLWeight, t) -> np.ndarray:
    """float32 of a record's dequantized values rearranged by a family's split (a tensor no block survives)."""
    return np.ascontiguousarray(t.split.floats(np.asarray(rec.dequantize(), np.float32)))


def output_path(out) -> Path:
    """The GGUF file ``out`` names: itself when it ends in ``.gguf`` (and is no folder), else ``out/model.gguf``."""
    path = Path(os.fspath(out))
    return path if path.suffix.lower() == ".gguf" and not path.is_dir() else path / "model.gguf"


def export_gguf(model, result=None, out="model.gguf", *, overwrite: bool = False, tokenizer=None,
                float_type: str = "f16", file_type: int | None = None, name: str | None = None,
                float_embeddings: bool = False, verify: bool = True) -> Path:
    """Writes ``model`` (quantized by ``result``, or float) as a GGUF file llama.cpp loads.

    Args:
      model: a transformers causal LM of a supported family (:data:`ARCHITECTURES`, one entry per family in
        :mod:`jgptq_torch.export.gguf.families`), holding the weights the records stand for (the exporter reads
        its unquantized tensors).
      result: None (every weight in ``float_type``), or an :class:`jgptq_torch.report.QuantizeResult`-like object:
        ``weights`` (name -> :class:`jgptq.export.GGMLWeight` in nn.Linear (..., out, in) orientation) keyed by
        model parameter name (a fused expert stack (E, 2I, H) under its parameter), or by checkpoint keys
        (per-expert, e.g. ``...experts.3.w1.weight``) that ``param_keys`` (parameter -> keys) groups.
      out: the file to write when it ends in ``.gguf``; otherwise a folder (created when missing) that gets
        ``model.gguf``.
      overwrite: replace an existing file.
      tokenizer: a transformers fast tokenizer with a byte-level BPE vocabulary whose pre-tokenizer llama.cpp
        implements (GPT-2, Qwen2, Llama 3; see :mod:`jgptq_torch.export.gguf.vocab`), or None: the file then gets
        ``tokenizer.ggml.model = "none"`` and ``vocab_size`` dummy tokens (llama.cpp is fed token ids directly).
      float_type: ``"f32"``, ``"f16"`` or ``"bf16"`` for every 2-D weight without a record (norms and routers
        are always f32).
      file_type: ``general.file_type`` (a llama.cpp LLAMA_FTYPE value); default: the mix preset of
        ``result.config.mix`` (q4_k_m -> MOSTLY_Q4_K_M), else the records' dominant format under its plain
        llama.cpp type (q8_0 -> MOSTLY_Q8_0; q3_k/q4_k/q5_k -> their _S type), else ``float_type``.
      name: ``general.name``; default: the basename of ``model.config._name_or_path`` (the folder the model was
        loaded from), else the model's class name.
      float_embeddings: keep the token embedding and the output head in ``float_type``. By default a GGML run's
        (``result.config`` with a GGML format) are encoded as llama.cpp's quantizer does for the run's mix or format
        (:func:`jgptq.plan.edge_formats`: q4_k_m -> token_embd q4_k, output q6_k): a plain encode, with the run's
        importance statistic of the head where it has one; each is added to ``result.report.records``.
      verify: read the file back before it is put in place and compare every tensor's bytes
        (:func:`jgptq.export.write_gguf`).
    Returns:
      The path written.
    Raises:
      UnsupportedGGUFModel: an unsupported family or setting (the message lists the supported families).
      NotImplementedError: a tokenizer llama.cpp would tokenize differently (SentencePiece, other patterns...).
      ValueError: a record of the wrong type, shape or format (rows not a multiple of its block), a record for a
        norm or router, or keys that belong to no parameter. FileExistsError: ``out`` exists, no ``overwrite``.
    """
    share_gpu_with_torch()
    path = output_path(out)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass {option('overwrite')} to replace it")
    file = GGUFFile(model, tokenizer=tokenizer, float_type=float_type)
    records = assemble(model, result, file.params) if result is not None else {}
    for param, rec in records.items():
        file.check_record(param, rec)
    formats = record_formats(records.values())  # the run's own records: general.file_type and edge rules
    edges = (edge_records(result, file.plan, file.state, records, formats)
             if result is not None and not float_embeddings else {})
    records.update(edges)
    for param in records:
        if not file.plan[param]:  # a quantized head of a tied model: written, llama.cpp then loads it as the head
            file.plan[param] = [Target(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight", role="output")]
    tensors = [file.tensor(param, t, records.get(param)) for param, t in file.entries()]
    meta = file.metadata(result, formats, file_type, name)
    return write_gguf(path, file.spec.name, meta, tensors, overwrite=overwrite, verify=verify)


_LAYER = re.compile(r"^blk\.(\d+)\.")


class GGUFFile:
    """What the GGUF file of ``model`` holds, known before any record exists: the architecture, each parameter's
    GGUF tensors (:func:`jgptq_torch.export.gguf.arch.targets`) and shapes, their order in the file, the metadata.

    File order: the tensors of each decoder layer (``blk.N.*``) in layer order, then the rest (token embedding,
    final norm, output head, RoPE factors), so that a file written while a run goes (:mod:`jgptq_torch.export.gguf.stream`)
    takes each layer's tensors as that layer is done.
    """

    def __init__(self, model, *, tokenizer=None, float_type: str = "f16"):
        if float_type not in FLOAT_TYPES:
            raise ValueError(f"float_type {float_type!r} is not one of {FLOAT_TYPES}")
        self.model, self.float_type = model, float_type
        self.spec = arch_of(model)
        self.vocab = {gguf.Keys.Tokenizer.MODEL: "none"}
        if tokenizer is not None:
            self.vocab = vocab_metadata(tokenizer, int(model.config.vocab_size))
        self.state = model.state_dict()
        self.plan = targets(model, self.spec)
        self.params = {p: tuple(_shape(model, p, t)) for p, t in self.state.items()}
        self.freqs = rope_freqs(model.config)

    def check_record(self, param: str, rec: GGMLWeight) -> None:
        """Raises ValueError for a record that does not fit ``param`` (shape, or a norm/router llama.cpp keeps in
        floating point)."""
        if tuple(rec.shape) != self.params[param]:
            raise ValueError(f"{param}: record shape {tuple(rec.shape)} does not match the parameter "
                             f"{self.params[param]} (nn.Linear orientation)" + _block_hint(self.params[param], rec))
        if any(t.role in _FLOAT32_ROLES for t in self.plan[param]):
            raise ValueError(f"{param}: llama.cpp keeps norms, biases and routers in floating point; leave it out "
                             f"of the result")

    def entries(self) -> list:
        """[(parameter name or None for the RoPE factors, :class:`Target`)] in file order."""
        found = [(param, t) for param, entries in self.plan.items() for t in entries]
        if self.freqs is not None:
            found.append((None, Target(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", role="norm")))
        if self.spec.output_required and not any(t.name == "output.weight" for _, t in found):
            raise UnsupportedGGUFModel(f"{type(self.model).__name__}: llama.cpp's {self.spec.name} needs an output "
                                       f"head")

        def place(entry):
            m = _LAYER.match(entry[1].name)
            return (0, int(m.group(1))) if m else (1, 0)

        return sorted(found, key=place)     # stable: plan order within a layer and in the rest

    def shape(self, param, t) -> tuple:
        """The logical shape (numpy order) of the GGUF tensor ``t`` of ``param``."""
        if param is None:
            return tuple(self.freqs.shape)
        full = self.params[param]
        if t.split is not None:
            return tuple(t.split.shape(full))
        if t.rows is None:
            shape = full
        elif t.role == "bias":
            shape = full[:-1] + (len(range(*t.rows.indices(full[-1]))),)
        else:
            shape = full[:-2] + (len(range(*t.rows.indices(full[-2]))), full[-1])
        return (int(np.prod(shape)),) if t.flat else shape

    def tensor(self, param, t, rec=None) -> GGUFTensor:
        """The :class:`GGUFTensor` of target ``t`` of ``param``: the record's blocks, or the float parameter
        (read when written)."""
        shape = self.shape(param, t)
        if param is None:
            return GGUFTensor(t.name, self.freqs, "f32")
        if rec is not None and t.split is not None:
            keeps = t.split.keeps_blocks   # a bool, or a test of the record (its format's block size)
            if not (keeps(rec) if callable(keeps) else keeps):
                return GGUFTensor(t.name, functools.partial(_split_dequantized, rec, t), self.float_type, shape)
            return GGUFTensor(t.name, functools.partial(_split_blocks, rec, t), rec.format, shape)
        if rec is not None:
            return GGUFTensor(t.name, functools.partial(_payload_rows, rec, t), rec.format, shape)
        kind = "f32" if t.role in _FLOAT32_ROLES or len(shape) == 1 else self.float_type
        return GGUFTensor(t.name, functools.partial(_float_rows, self.model, param, self.state[param], t), kind,
                          shape)

    def metadata(self, result, formats: Counter, file_type: int | None = None, name: str | None = None) -> dict:
        """The file's metadata: name, architecture keys, file type (default from ``formats`` and the run's mix),
        quantization version, vocabulary, a target_bpw run's allocation."""
        if file_type is None:
            mix = getattr(getattr(result, "config", None), "mix", None)
            file_type = _file_type(formats, self.float_type, mix if formats else None)
        meta = {gguf.Keys.General.NAME: name or _model_name(self.model)}
        meta.update(metadata(self.model, self.spec))
        meta[gguf.Keys.General.FILE_TYPE] = int(file_type)
        meta[gguf.Keys.General.QUANTIZATION_VERSION] = QUANTIZATION_VERSION
        meta.update(self.vocab)
        meta.update(_allocation_metadata(result))
        return meta


def _allocation_metadata(result) -> dict:
    """``jgptq.target_bpw`` and ``jgptq.allocation`` (the report's allocation as JSON text) of a target_bpw run."""
    allocation = getattr(getattr(result, "report", None), "allocation", None)
    if not allocation:
        return {}
    import json

    return {"jgptq.target_bpw": float(allocation["target_bpw"]), "jgptq.allocation": json.dumps(allocation)}


def _shape(model, param: str, tensor: torch.Tensor) -> tuple:
    shape = tuple(tensor.shape)
    module = None
    try:
        module = model.get_submodule(param.rpartition(".")[0])
    except AttributeError:
        pass
    if (module is not None and len(shape) == 3 and models.is_experts_module(module)
            and models.ExpertsLayout.of(module).transposed):
        shape = shape[:-2] + (shape[-1], shape[-2])
    return shape


def _block_hint(shape: tuple, rec: GGMLWeight) -> str:
    if shape and shape[-1] % rec.block_size:
        return (f"; its rows of {shape[-1]} values are not a multiple of the {rec.format} block "
                f"({rec.block_size}), so this format cannot hold it")
    return ""


def export_imatrix(model, imatrix, path, *, datasets=(), chunk_count: int = 0, chunk_size: int = 0,
                   overwrite: bool = False):
    """Writes ``imatrix`` (model parameter name -> :class:`jgptq.imatrix.ImatrixEntry`) as a GGUF imatrix file
    under the GGUF tensor names of ``model`` (both halves of a fused gate_up get the parameter's entry; a family's
    split tensor gets what its split derives, e.g. deepseek2's ``attn_v_b`` the entry once per head and
    ``attn_k_b``, whose input is another activation, none).

    Args:
      model: the transformers model of a supported family (the names of :func:`gguf_names`).
      imatrix: parameter name (``state_dict`` naming) -> entry with ``sums`` float32 (E, in_features) and
        ``counts`` float32 (E,) (E = 1 for a dense weight), e.g. ``result.imatrix`` of a GGML run.
      path, datasets, chunk_count, chunk_size, overwrite: passed to :func:`jgptq.imatrix.write_imatrix`.
    Returns:
      The path written.
    Raises:
      ValueError: a name that is not a parameter of the model, a parameter with no GGUF tensor, or an entry whose
        shape does not match its parameter (experts x input columns).
    """
    from jgptq.imatrix import ImatrixEntry, write_imatrix

    spec = arch_of(model)
    plan = targets(model, spec)
    state = model.state_dict()
    entries = {}
    for param, entry in imatrix.items():
        if param not in plan:
            raise ValueError(f"imatrix entry {param!r} is not a parameter of {type(model).__name__}")
        shape = _shape(model, param, state[param])
        if len(shape) < 2 or any(t.role in _FLOAT32_ROLES for t in plan[param]):
            raise ValueError(f"imatrix entry {param!r}: llama.cpp quantizes no norm or router; leave it out")
        sums = np.asarray(entry[0], np.float32)
        sums = sums[None] if sums.ndim == 1 else sums
        experts = shape[0] if len(shape) == 3 else 1
        if sums.shape != (experts, shape[-1]):
            raise ValueError(f"imatrix entry {param!r}: sums {sums.shape} do not match the parameter {shape} "
                             f"(expected ({experts}, {shape[-1]}))")
        counts = np.asarray(entry[1], np.float32).reshape(-1)
        for t in plan[param]:
            if t.split is not None:  # a family's rearrangement: its own statistic, or none (another input)
                found = t.split.imatrix(sums, counts)
                if found is not None:
                    entries[t.name] = ImatrixEntry(*found)
                continue
            entries[t.name] = ImatrixEntry(sums, counts)
    return write_imatrix(path, entries, datasets=datasets, chunk_count=chunk_count, chunk_size=chunk_size,
                         overwrite=overwrite)
