"""Pieces both integer-grid exporters share: entry iteration, module names, the model config."""

from __future__ import annotations

import copy
from typing import Iterable, Mapping

from jgptq.version import __version__


def iterate_entries(entries, what: str) -> Iterable[tuple[str, object]]:
    """(name, value) pairs of a mapping or of an iterable of pairs."""
    if isinstance(entries, Mapping):
        yield from entries.items()
        return
    for item in entries:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"{what}: expected (name, value) pairs, got {type(item).__name__}")
        yield item


def module_name(name: str) -> str:
    """The module a quantized weight belongs to: ``name`` without a trailing ``.weight``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"module name {name!r} must be a non-empty string")
    return name[: -len(".weight")] if name.endswith(".weight") else name


def check_model_config(model_config) -> None:
    """Refuses a model config that is not a dict with a ``model_type`` (transformers needs it)."""
    if not isinstance(model_config, Mapping):
        raise ValueError(f"model_config must be the model's config.json as a dict, got {type(model_config).__name__}")
    if "model_type" not in model_config:
        raise ValueError("model_config has no 'model_type'; pass the model's config.json contents "
                         "(e.g. model.config.to_dict())")


def finish_config(model_config: Mapping, quantization_config: dict) -> dict:
    """A copy of the model config with ``quantization_config`` set."""
    out = copy.deepcopy(dict(model_config))
    out["quantization_config"] = quantization_config
    return out


def version_tag() -> str:
    """``"jgptq:<version>"``, the quantizer entry of checkpoint metadata."""
    return f"jgptq:{__version__}"
