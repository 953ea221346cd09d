"""The tensors of a decoder layer and the layer files of disk offload.

- :func:`tensor_slots`, :func:`unique_tensors`, :func:`nbytes`, :func:`host_bytes`, :func:`is_released`: what a
  module holds (parameters and buffers, tied tensors once) and where.
- :func:`write_layer`, :func:`release_layer`, :func:`read_layer`, :func:`load_layer`, :func:`reload_all`: a layer
  file holds each distinct tensor of the layer once (parameters and buffers, persistent or not), under its
  ``state_dict`` name; tied tensors are listed as aliases in the header and are tied again on loading. Files are
  written under a temporary name and renamed into place. A released layer's tensors are meta tensors (no storage).
- :class:`LayerFolder`: the folder of a run's layer files; :func:`check_not_shared`: no tensor of a layer that is
  to be released belongs elsewhere too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from jgptq_torch import models
from jgptq_torch.write_errors import writing

FILE = "offload-layer-{:05d}.safetensors"
FORMAT = "jgptq-offload-layer"


# -- tensors of a module ---------------------------------------------------------------------------------------
def tensor_slots(module: nn.Module):
    """(state_dict-style name, owner, "_parameters" | "_buffers", attribute, tensor) for every tensor slot of
    ``module``: a tensor tied to several places appears once per place."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(owner, kind).items():
                if t is not None:
                    yield (f"{prefix}.{attr}" if prefix else attr), owner, kind, attr, t


def unique_tensors(module: nn.Module) -> dict:
    """id -> tensor of every distinct parameter and buffer of ``module`` (tied tensors once)."""
    return {id(t): t for _, _, _, _, t in tensor_slots(module)}


def nbytes(tensors) -> int:
    """Bytes of the storage of ``tensors`` (an iterable of tensors; meta tensors count as if materialized)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def host_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s distinct parameters and buffers that are in host memory (on the CPU) now."""
    return nbytes(t for t in unique_tensors(model).values() if t.device.type == "cpu")


def is_released(layer: nn.Module) -> bool:
    """True when any tensor of ``layer`` is on the meta device (released by disk offload)."""
    return any(t.device.type == "meta" for t in unique_tensors(layer).values())


# -- layer files ------------------------------------------------------------------------------------------------
def layer_file(directory, i: int) -> Path:
    """The file of decoder layer ``i`` in ``directory``."""
    return Path(directory) / FILE.format(i)


def write_layer(layer: nn.Module, path) -> None:
    """Writes every distinct tensor of ``layer`` to the safetensors file ``path`` (atomically: a temporary name,
    then a rename), tied tensors once with their other names as aliases.

    Raises:
      ValueError: a tensor of the layer is released (on meta): there is nothing to write.
    """
    from safetensors.torch import save_file

    path = Path(path)
    first: dict = {}
    aliases, tensors, storages = {}, {}, set()
    for name, _, _, _, t in tensor_slots(layer):
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        if t.device.type == "meta":
            raise ValueError(f"{name}: the tensor is released (meta device); load the layer before writing it")
        data = t.detach()
        storage = (str(data.device), data.untyped_storage().data_ptr())
        if data.numel() and storage in storages:  # distinct tensors over one storage: stored apart
            data = data.clone()
        storages.add(storage)
        tensors[name] = data.contiguous()
    meta = {"format": FORMAT, "aliases": json.dumps(aliases)}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):   # a full disk or another OS error names the file
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def release_layer(layer: nn.Module) -> None:
    """Replaces every tensor of ``layer`` by a meta tensor of the same shape, dtype and kind (parameters stay
    parameters, ties stay tied), so that its storage is freed once nothing else holds it."""
    twins: dict = {}
    for _, owner, kind, attr, t in list(tensor_slots(layer)):
        twin = twins.get(id(t))
        if twin is None:
            empty = torch.empty(t.shape, dtype=t.dtype, device="meta")
            twin = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
            twins[id(t)] = twin
        getattr(owner, kind)[attr] = twin


def read_layer(layer: nn.Module, path, device="cpu") -> None:
    """Fills ``layer`` (released or not) with the tensors of the file ``path``, placed on ``device``.

    Raises:
      ValueError: the file is not a layer file, or its names, shapes or dtypes are not the layer's.
    """
    from safetensors import safe_open

    path = Path(path)
    slots = list(tensor_slots(layer))
    with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a jgptq layer file (format {meta.get('format')!r})")
        aliases = json.loads(meta["aliases"])
        stored = set(f.keys()) | set(aliases)
        wanted = {name for name, *_ in slots}
        if stored != wanted:
            raise ValueError(f"{path}: holds other tensors than the layer (only in the file: "
                             f"{sorted(stored - wanted)[:5]}, only in the layer: {sorted(wanted - stored)[:5]})")
        made: dict = {}
        for name, owner, kind, attr, t in slots:
            key = aliases.get(name, name)
            new = made.get(key)
            if new is None:
                data = f.get_tensor(key)
                if tuple(data.shape) != tuple(t.shape) or data.dtype != t.dtype:
                    raise ValueError(f"{path}: {key} is {tuple(data.shape)} {data.dtype} in the file but "
                                     f"{tuple(t.shape)} {t.dtype} in the layer")
                new = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
                made[key] = new
            getattr(owner, kind)[attr] = new


def load_layer(model: nn.Module, i: int, offload_dir, device="cpu") -> nn.Module:
    """Loads decoder layer ``i`` of ``model`` from its file in ``offload_dir`` onto ``device``; returns the layer.

    The model returned by ``quantize_moe(..., offload="disk", reload=False, offload_dir=DIR)`` has its layers on
    the meta device and their quantized tensors in DIR: ``load_layer(model, i, DIR)`` makes layer ``i`` usable.
    """
    layer = models.find_decoder_layers(model)[1][i]
    read_layer(layer, layer_file(offload_dir, i), device)
    return layer


def reload_all(model: nn.Module, offload_dir, device="cpu") -> None:
    """Loads every released decoder layer of ``model`` from ``offload_dir`` onto ``device`` (the whole model is
    then usable, e.g. for export)."""
    for i, layer in enumerate(models.find_decoder_layers(model)[1]):
        if is_released(layer):
            read_layer(layer, layer_file(offload_dir, i), device)


def check_not_shared(model, layers) -> None:
    """Disk offload releases a layer's tensors: none may also belong to another layer or to the rest of the model."""
    owner: dict = {}
    for i, layer in enumerate(layers):
        for name, _, _, _, t in tensor_slots(layer):
            if owner.setdefault(id(t), (i, name))[0] != i:
                raise ValueError(f"offload='disk': {name} of decoder layer {i} is the same tensor as "
                                 f"{owner[id(t)][1]} of layer {owner[id(t)][0]}; a layer file cannot hold it "
                                 f"(use offload='cpu')")
    inside = {id(m) for layer in layers for m in layer.modules()}
    for name, module, _, _, t in tensor_slots(model):
        got = owner.get(id(t))
        if got is not None and id(module) not in inside:
            raise ValueError(f"offload='disk': {name} is the same tensor as {got[1]} of decoder layer {got[0]}; "
                             f"releasing the layer would release it too (use offload='cpu')")


# -- the folder of a run's layer files --------------------------------------------------------------------------
class LayerFolder:
    """The folder of the layer files of a disk-offloaded run: made (or a temporary one) when opened, its files
    removed at the end unless kept; ``written`` holds the layers whose file this run wrote."""

    def __init__(self, directory, keep: bool):
        self.dir, self.keep = directory, keep
        self.opened = self._made = self._temp = False
        self.written: set = set()

    def open(self) -> None:
        """Makes the folder (a temporary one when ``directory`` is None)."""
        if self.dir is None:
            self.dir, self._temp = tempfile.mkdtemp(prefix="jgptq-offload-"), True
        else:
            self._made = not Path(self.dir).exists()
            Path(self.dir).mkdir(parents=True, exist_ok=True)
        self.opened = True

    def file(self, i: int) -> Path:
        """The file of decoder layer ``i``."""
        return layer_file(self.dir, i)

    def remove(self, count: int) -> None:
        """Removes the files of layers ``0..count-1``, and the folder if this run made it and it is empty."""
        for i in range(count):
            self.file(i).unlink(missing_ok=True)
        if self._temp:
            shutil.rmtree(self.dir, ignore_errors=True)
        elif self._made:
            try:
                Path(self.dir).rmdir()
            except OSError:  # something else was put there: it stays
                pass
