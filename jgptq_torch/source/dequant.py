"""Dequantize-on-read: a subset of a checkpoint's tensors (one decoder layer's, say) in, plain float tensors out.

Each format names its quantized weight's companions by suffix:
- fp8_block: ``P.weight`` (float8_e4m3fn) + ``P.weight_scale_inv``  -> ``P.weight``
- mxfp4: ``X_blocks`` (uint8) + ``X_scales`` (uint8 E8M0)             -> ``X``
- pack_quantized: ``P.weight_packed`` + ``P.weight_scale`` + ``P.weight_shape`` (+ ``P.weight_zero_point`` when
  asymmetric)                                                        -> ``P.weight``
Everything else passes through, floating tensors cast to the requested dtype.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from .formats import SourceFormat, pack_scheme

# suffix -> role, per format; the plain name is the checkpoint name with the suffix replaced by the plain suffix
_ROLES = {
    "fp8_block": {".weight_scale_inv": "scale", ".weight": "weight"},
    "mxfp4": {"_blocks": "blocks", "_scales": "scales"},
    "pack_quantized": {".weight_packed": "packed", ".weight_scale": "scale", ".weight_shape": "shape",
                       ".weight_zero_point": "zero_point"},
}
_PLAIN_SUFFIX = {"fp8_block": ".weight", "mxfp4": "", "pack_quantized": ".weight"}
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                            "float8_e8m0fnu") if hasattr(torch, n))


def _split(name: str, fmt: SourceFormat) -> tuple[str, str] | None:
    """(plain name, role) for a checkpoint name that may belong to a quantized weight, else None."""
    for suffix, role in _ROLES[fmt.name].items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + _PLAIN_SUFFIX[fmt.name], role
    return None


def _suffix_of(fmt: SourceFormat, role: str) -> str:
    return next(s for s, r in _ROLES[fmt.name].items() if r == role)


def _module_of(plain: str, fmt: SourceFormat) -> str:
    if fmt.name == "mxfp4":
        return plain.rsplit(".", 1)[0]
    return plain[: -len(".weight")]


def _roles_needed(plain: str, fmt: SourceFormat) -> tuple[str, ...]:
    if fmt.name == "fp8_block":
        return ("weight", "scale")
    if fmt.name == "mxfp4":
        return ("blocks", "scales")
    scheme = pack_scheme(fmt, _module_of(plain, fmt))
    return ("packed", "scale", "shape") + (() if scheme.symmetric else ("zero_point",))


def companions(name: str, fmt: SourceFormat | None, available: Collection[str] | None = None) -> list[str]:
    """The checkpoint names to read together with ``name`` so that :func:`dequantize_tensors` can dequantize it.

    For a quantized weight's part (``...weight_scale_inv``, ``..._blocks``, ``...weight_packed`` ...) the other
    parts; for an FP8 ``...weight`` of a module not in the ignore list its ``weight_scale_inv`` (a float weight,
    such as a router's, has none: pass ``available``, the checkpoint's tensor names, and names not in it are
    dropped). [] for a float checkpoint (fmt None) and for tensors outside any quantized group."""
    if fmt is None:
        return []
    split = _split(name, fmt)
    if split is None:
        return []
    plain, role = split
    if fmt.is_ignored(_module_of(plain, fmt)) and role == "weight":
        return []
    base = plain[: len(plain) - len(_PLAIN_SUFFIX[fmt.name])]
    names = [base + _suffix_of(fmt, r) for r in _roles_needed(plain, fmt) if r != role]
    if available is not None:
        names = [n for n in names if n in available]
    return names


def _plain(name: str, tensor: torch.Tensor, dtype: torch.dtype, fmt: SourceFormat | None) -> torch.Tensor:
    if tensor.dtype in _FLOAT8:
        where = "has no quantization_config" if fmt is None else f"is {fmt.name}"
        raise ValueError(f"{name}: a {tensor.dtype} tensor with no scale to read it by (config.json {where})")
    return tensor.to(dtype) if tensor.dtype.is_floating_point else tensor


def dequantize_tensors(tensors: dict[str, torch.Tensor], fmt: SourceFormat | None,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantize a subset of a checkpoint's tensors to plain float tensors.

    tensors: checkpoint name -> tensor as safetensors reads it (CPU or CUDA); a quantized weight's companions must
    be in the same subset. fmt: from :func:`source_format` (None: a float checkpoint). dtype: the float dtype out.
    Returns plain name -> tensor of ``dtype`` on the input's device (companions consumed; non-floating tensors that
    belong to no quantized weight pass unchanged), in the order the names first appear. Raises ValueError naming
    the tensors for a missing companion, a wrong scale shape, a weight of a module config.json leaves in float that
    carries quantized parts, or two tensors landing on one plain name."""
    if not dtype.is_floating_point:
        raise ValueError(f"dequantize_tensors: dtype must be floating point, got {dtype}")
    groups: dict[str, dict[str, str]] = {}
    order: list[tuple[str, str | None]] = []
    for name in tensors:
        split = None if fmt is None else _split(name, fmt)
        if split is None:
            order.append((name, None))
            continue
        plain, role = split
        if plain not in groups:
            groups[plain] = {}
            order.append((plain, plain))
        groups[plain][role] = name
    out: dict[str, torch.Tensor] = {}
    for plain, group_key in order:
        if group_key is None:
            value = _plain(plain, tensors[plain], dtype, fmt)
        else:
            value = _dequantize_group(plain, {r: (n, tensors[n]) for r, n in groups[plain].items()}, fmt, dtype)
        if plain in out:
            raise ValueError(f"{plain}: given both as a plain tensor and as a quantized weight's parts")
        out[plain] = value
    return out


def _dequantize_group(plain: str, parts: dict[str, tuple[str, torch.Tensor]], fmt: SourceFormat,
                      dtype: torch.dtype) -> torch.Tensor:
    if fmt.name == "fp8_block" and set(parts) == {"weight"}:
        name, weight = parts["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            return _plain(name, weight, dtype, fmt)  # a float weight (router, norm, ignored module)
    module = _module_of(plain, fmt)
    base = plain[: len(plain) - len(_PLAIN_SUFFIX[fmt.name])]
    if fmt.is_ignored(module):
        raise ValueError(
            f"{', '.join(n for n, _ in parts.values())}: module {module!r} is in config.json's ignore list "
            f"({fmt.name}) but the checkpoint stores it quantized"
        )
    needed = _roles_needed(plain, fmt)
    missing = [base + _suffix_of(fmt, r) for r in needed if r not in parts]
    if missing:
        have = ", ".join(n for n, _ in parts.values())
        raise ValueError(f"{have}: needs {', '.join(missing)}, missing from the tensors given ({fmt.name})")
    extra = [n for r, (n, _) in parts.items() if r not in needed]
    if extra:
        raise ValueError(f"{', '.join(extra)}: not expected beside {plain} ({fmt.name}, config.json)")
    if fmt.name == "fp8_block":
        from .fp8 import dequantize_fp8_block

        return dequantize_fp8_block(parts["weight"][1], parts["scale"][1], fmt.block_size, dtype,
                                    scale_fmt=fmt.scale_fmt, name=parts["weight"][0])
    if fmt.name == "mxfp4":
        from .mxfp4 import dequantize_mxfp4

        return dequantize_mxfp4(parts["blocks"][1], parts["scales"][1], dtype, name=base)
    from .packed import dequantize_packed

    return dequantize_packed({r: t for r, (_, t) in parts.items()}, pack_scheme(fmt, module), dtype, name=base)
