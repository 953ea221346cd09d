"""A checkpoint folder read one decoder layer at a time: :class:`CheckpointSource`.

The model's skeleton is built on the meta device from ``config.json`` (:meth:`CheckpointSource.skeleton`: no
storage at all, but for the non-persistent buffers such as rotary frequencies, which transformers' own weight
init computes). A part of the model (one decoder layer, the input embedding) is then filled from the safetensors
files when it is needed (:meth:`CheckpointSource.load`): its checkpoint tensors are read from the shards named by
``model.safetensors.index.json`` (or the single ``model.safetensors``) and handed to transformers' own loading
(``core_model_loading.convert_and_load_state_dict_in_model`` with the model's conversion mapping), so that
renamings and fusions, e.g. the per-expert ``mlp.experts.{e}.gate_proj.weight`` stacked into the 3-D
``experts.gate_up_proj``, are exactly what ``from_pretrained`` does. :func:`release_outside` puts the tensors
outside the decoder layers back on meta (a layer goes back with ``layer_files.release_layer``).

A quantized release (FP8 with block scales, MXFP4 experts, compressed-tensors ``pack-quantized``; recognised from
``config.json`` by :func:`jgptq_torch.source.dequant.source_format`) is dequantized on read, one part at a time
(:func:`jgptq_torch.source.dequant.dequantize_tensors`, to the run's dtype), before transformers' conversions.

Which checkpoint tensors belong to which part is decided once, from each key's name after transformers'
renaming: the keys under decoder layer ``i`` (``model.layers.i.``) and the rest (embeddings, final norm, head).
Only safetensors files are read (never pickle); no remote code runs unless asked for.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import struct
import warnings
from pathlib import Path

import torch
from torch import nn

from jgptq_torch.pipeline.layer_files import tensor_slots

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SourceError(ValueError):
    """The checkpoint folder cannot be read as the model its config names (the message says which file and why)."""


def weight_files(folder) -> dict:
    """Checkpoint key -> the safetensors file that holds it, from ``model.safetensors.index.json`` or the single
    ``model.safetensors`` of ``folder``.

    Raises:
      SourceError: neither file is there, the index names a missing file, or a key the index names is not in
        its file.
    """
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise SourceError(f"{index}: not a safetensors index (no readable 'weight_map': {exc})") from exc
        files = {k: folder / v for k, v in weight_map.items()}
    elif (folder / SINGLE).is_file():
        files = {k: folder / SINGLE for k in _header(folder / SINGLE)}
    else:
        raise SourceError(f"{folder}: no {INDEX} and no {SINGLE}; a checkpoint is read from safetensors files only")
    headers = {}
    for key, path in files.items():
        if path not in headers:
            if not path.is_file():
                raise SourceError(f"{index}: names {path.name} for {key}, which is not in {folder}")
            headers[path] = _header(path)
        if key not in headers[path]:
            raise SourceError(f"{path}: the index puts {key} in this file, but the file does not hold it")
    return files


def _header(path: Path) -> dict:
    """The tensor entries of a safetensors file's JSON header (name -> dtype, shape, offsets)."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise SourceError(f"{path}: not a readable safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    return header


class CheckpointSource:
    """A model folder (``config.json`` + safetensors shards) whose weights are read part by part.

    Args:
      folder: the model folder.
      dtype: the dtype floating weights are loaded in (a torch dtype; default: the config's ``dtype``, else
        float32), as ``from_pretrained(dtype=...)`` would.
      trust_remote_code: passed to ``AutoConfig`` / ``AutoModelForCausalLM`` (off by default).
    Raises:
      SourceError: a folder without the files (see :func:`weight_files`).
    """

    def __init__(self, folder, dtype=None, trust_remote_code: bool = False):
        from transformers import AutoConfig

        self.dir = Path(folder)
        if not (self.dir / "config.json").is_file():
            raise SourceError(f"{self.dir}: no config.json; a checkpoint folder needs one")
        self.files = weight_files(self.dir)
        self.trust_remote_code = trust_remote_code
        from jgptq_torch.source.formats import source_format

        try:
            raw = json.loads((self.dir / "config.json").read_text())
            self.format = source_format(raw)
        except ValueError as exc:
            raise SourceError(f"{self.dir / 'config.json'}: {exc}") from exc
        self.config = AutoConfig.from_pretrained(str(self.dir), trust_remote_code=trust_remote_code,
                                                 local_files_only=True)
        if self.format is not None and hasattr(self.config, "quantization_config"):
            del self.config.quantization_config   # weights are dequantized on read: the model is a float one
        if dtype is None:
            named = getattr(self.config, "dtype", None) or getattr(self.config, "torch_dtype", None)
            dtype = getattr(torch, named) if isinstance(named, str) else (named or torch.float32)
        self.dtype = dtype
        self.model = None
        self._parts: dict = {}
        self.bytes_read = 0
        self.peak_parameters = 0   # most bytes of the model's tensors materialized at once (checked after reads)

    # -- the skeleton ------------------------------------------------------------------------------------------
    def skeleton(self) -> nn.Module:
        """The model built from the config with every parameter and persistent buffer on the meta device (the
        non-persistent buffers, e.g. rotary frequencies, computed on the host by transformers' weight init).
        The checkpoint's keys are sorted into parts here (:meth:`part_of`). Returns the model (eval mode)."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype,
                                                     trust_remote_code=self.trust_remote_code)
        persistent = set(model.state_dict())
        for name, module in model.named_modules():
            own = [b for b, t in module._buffers.items() if t is not None and f"{name}.{b}".lstrip(".")
                   not in persistent]
            if own:
                for b in own:
                    module._buffers[b] = torch.empty_like(module._buffers[b], device="cpu")
                model._init_weights(module)
        model.eval()
        self.model = model
        self._sort_keys()
        if self.unplaced:   # said, as from_pretrained says its unexpected keys
            warnings.warn(f"{self.dir}: {len(self.unplaced)} checkpoint tensors belong to no part of "
                          f"{type(model).__name__} and are not read (e.g. {self.unplaced[:3]}); from_pretrained "
                          f"leaves them out too", stacklevel=2)
        return model

    def _sort_keys(self) -> None:
        from jgptq_torch import models
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.mapping = get_model_conversion_mapping(self.model)
        renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        meta_state = self.model.state_dict()
        self.prefix, layers = models.find_decoder_layers(self.model)
        self.layer_count = len(layers)
        under = re.compile(rf"^{re.escape(self.prefix)}\.(\d+)\.")
        emb = self.model.get_input_embeddings()
        self.embedding = next(n for n, m in self.model.named_modules() if m is emb)
        self._parts = {}
        self.unplaced = []
        for key in self.files:
            target, _ = rename_source_key(key, renamings, converters, self.model.base_model_prefix, meta_state)
            if target not in meta_state and key in meta_state:
                target = key
            if target not in meta_state:
                m = under.match(key) if self.format is not None else None
                if m is None or int(m.group(1)) >= self.layer_count:
                    self.unplaced.append(key)   # transformers would ignore it too (e.g. multi-token prediction)
                    continue
                target = key   # a quantized weight's part (scales, packed codes), read with its weight
            m = under.match(target)
            part = int(m.group(1)) if m else "embedding" if target.startswith(self.embedding + ".") else "outside"
            self._parts.setdefault(part, []).append((key, target))

    def part_of(self, part) -> list:
        """The checkpoint keys of ``part`` (a decoder layer index, ``"embedding"``: the input embedding, or
        ``"outside"``: the rest, final norm and head), in the files' order."""
        return [k for k, _ in self._parts.get(part, [])]

    def targets_of(self, part) -> list:
        """The model's tensor names that the keys of ``part`` fill (a fused tensor once per source key)."""
        return sorted({t for _, t in self._parts.get(part, [])})

    # -- reading -------------------------------------------------------------------------------------------------
    def read(self, keys, device="cpu") -> dict:
        """The checkpoint tensors ``keys`` as they are stored (dtype and name), read onto ``device``.

        Returns:
          checkpoint key -> tensor.
        """
        from safetensors import safe_open

        out = {}
        by_file: dict = {}
        for k in keys:
            by_file.setdefault(self.files[k], []).append(k)
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
                for k in names:
                    t = f.get_tensor(k)
                    self.bytes_read += t.numel() * t.element_size()
                    out[k] = t
        return out

    def load(self, module_names, part, device="cpu") -> None:
        """Fills the tensors of ``part`` (decoder layer index or ``"outside"``; ``module_names``: for errors)
        in :attr:`model` from the checkpoint, converted by transformers' loading, on ``device``.

        Raises:
          SourceError: a tensor of the part is missing from the checkpoint, or its shape is not the model's.
        """
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        keys = self.part_of(part)
        tensors = self.read(keys, "cpu" if torch.device(device).type == "meta" else device)
        if self.format is not None:
            from jgptq_torch.source.dequant import dequantize_tensors

            try:
                tensors = dequantize_tensors(tensors, self.format, self.dtype)
            except ValueError as exc:
                raise SourceError(f"{self.dir}: {module_names}: {exc}") from exc
        load_cfg = LoadStateDictConfig(device_map={"": torch.device(device)}, dtype=self.dtype,
                                       weight_mapping=self.mapping)
        with _quiet_loading():
            info, _ = convert_and_load_state_dict_in_model(self.model, tensors, load_cfg)
        del tensors
        live = {id(t): t for _, _, _, _, t in tensor_slots(self.model) if t.device.type != "meta"}
        self.peak_parameters = max(self.peak_parameters, sum(t.numel() * t.element_size() for t in live.values()))
        problems = []
        if info.mismatched_keys:
            problems += [f"{k} is {tuple(a)} in the checkpoint but {tuple(b)} in the model"
                         for k, a, b in sorted(info.mismatched_keys)[:5]]
        if getattr(info, "conversion_errors", None):
            problems += [f"{k}: {v}" for k, v in list(info.conversion_errors.items())[:5]]
        wanted = set(self.expected(part))
        missing = sorted(wanted & set(info.missing_keys))
        if missing:
            problems.append(f"missing from the checkpoint: {missing[:5]}")
        if problems:
            raise SourceError(f"{self.dir}: {module_names}: {'; '.join(problems)}")

    def expected(self, part) -> list:
        """The model's persistent tensor names that belong to ``part`` (what :meth:`load` must fill)."""
        names = []
        for name in self.model.state_dict():
            inside = re.match(rf"^{re.escape(self.prefix)}\.(\d+)\.", name)
            embedding = name.startswith(self.embedding + ".")
            if part == "embedding":
                keep = embedding
            elif part == "outside":
                keep = not inside and not embedding
            else:
                keep = inside is not None and int(inside.group(1)) == part
            if keep:
                names.append(name)
        tied = set(getattr(self.model, "all_tied_weights_keys", {}) or {})
        return [n for n in names if n not in tied]

    def fingerprint(self) -> str:
        """A digest of what the checkpoint holds without reading its tensors: ``config.json`` and every shard's
        size and header (names, dtypes, shapes, offsets). Hashing every tensor byte of a model no machine holds
        would read it all once more; a changed weight of the same shape in a file of the same size is not seen."""
        h = hashlib.blake2b(digest_size=16)
        h.update((self.dir / "config.json").read_bytes())
        for path in sorted(set(self.files.values())):
            h.update(f"{path.name}|{path.stat().st_size}|".encode())
            h.update(json.dumps(_header(path), sort_keys=True).encode())
        return h.hexdigest()


def release_outside(model: nn.Module, layers: nn.Module) -> None:
    """Puts every persistent tensor of ``model`` outside ``layers`` (the decoder layers) back on the meta device;
    non-persistent buffers (rotary frequencies) stay."""
    persistent = set(model.state_dict())
    inside = {id(m) for m in layers.modules()}
    for name, owner, kind, attr, t in list(tensor_slots(model)):
        if id(owner) in inside or name not in persistent or t.device.type == "meta":
            continue
        empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
        getattr(owner, kind)[attr] = nn.Parameter(empty, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else empty


@contextlib.contextmanager
def _quiet_loading():
    """transformers' loading shows a progress bar per call; one layer at a time it is noise."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
