"""The source format of a checkpoint, read from ``config.json``'s ``quantization_config``.

Supported: ``quant_method: "fp8"`` with ``weight_block_size`` (DeepSeek-V3/R1, Kimi-K2, Qwen3 and GLM ``-FP8``
releases), ``quant_method: "mxfp4"`` (gpt-oss experts) and ``quant_method: "compressed-tensors"`` with
``format: "pack-quantized"`` integer weights (Kimi-K2-Thinking and other llm-compressor releases) or one value a
byte (``float-quantized`` FP8, ``int-quantized`` int8: the ``-FP8-dynamic``/``-FP8-block``/``W8A8`` releases).
Anything else is refused with an error naming config.json, the value found and the supported values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED_METHODS = ("fp8", "mxfp4", "compressed-tensors")
CT_NAMES = ("pack_quantized", "compressed_tensors")
FP8_SCALE_FORMATS = ("float", "ue8m0")
CT_FORMATS = ("pack-quantized", "float-quantized", "int-quantized", "naive-quantized")
PACK_STRATEGIES = ("group", "channel")
BYTE_STRATEGIES = ("channel", "group", "block", "tensor")


@dataclass(frozen=True)
class PackScheme:
    """One compressed-tensors config group.

    targets: the group's ``targets`` (``"re:"`` regexes, exact module names, or class names such as ``"Linear"``);
    num_bits 1..8 (8 for the one-value-a-byte formats); symmetric (False: a ``weight_zero_point`` is stored);
    strategy ``"group"``, ``"channel"`` (pack-quantized) or also ``"block"``, ``"tensor"`` (the others);
    group_size (group only); format: ``"pack-quantized"`` (int values packed in int32), ``"float-quantized"``
    (float8_e4m3fn weights), ``"int-quantized"`` (int8 weights), ``"naive-quantized"`` (either); type
    ``"int"`` or ``"float"``; block: (rows, cols) of a scale block (block only)."""

    targets: tuple[str, ...]
    num_bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    format: str = "pack-quantized"
    type: str = "int"
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class SourceFormat:
    """How a checkpoint's weights are stored.

    name: ``"fp8_block"``, ``"mxfp4"``, ``"pack_quantized"`` (compressed-tensors, every group pack-quantized) or
    ``"compressed_tensors"`` (compressed-tensors with float-, int- or naive-quantized groups).
    block_size: (rows, cols) of one FP8 scale block (fp8_block only).
    scale_fmt: ``"float"`` or ``"ue8m0"`` (power-of-two scales; fp8_block only).
    schemes: the config groups (the compressed-tensors formats).
    ignore: module patterns left in float (``modules_to_not_convert`` or compressed-tensors ``ignore``).
    """

    name: str
    block_size: tuple[int, int] | None = None
    scale_fmt: str = "float"
    schemes: tuple[PackScheme, ...] = ()
    ignore: tuple[str, ...] = ()

    def is_ignored(self, module: str) -> bool:
        """Whether ``module`` (a dotted module name, no ``.weight``) is listed as left in float."""
        if not self.ignore:
            return False
        if self.name in CT_NAMES:
            return any(_ct_match(module, pattern) for pattern in self.ignore)
        return _hf_skip(module, self.ignore)


def _ct_match(module: str, pattern: str) -> bool:
    """compressed-tensors' rule: ``re:`` regex matched at the start, else the exact name."""
    from compressed_tensors.utils.match import match_name

    return match_name(module, pattern)


def _hf_skip(module: str, patterns: tuple[str, ...]) -> bool:
    """transformers' rule for ``modules_to_not_convert`` (prefix at a module boundary, regex, or suffix)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    return not should_convert_module(module, list(patterns))


def _refuse(key: str, value, supported) -> ValueError:
    return ValueError(
        f"config.json: quantization_config.{key} is {value!r}; supported: {', '.join(map(repr, supported))}"
    )


def source_format(config: dict) -> SourceFormat | None:
    """The :class:`SourceFormat` of a checkpoint from its ``config.json`` (a dict as loaded from the file).

    Returns None for a float checkpoint (no ``quantization_config``). Raises ValueError naming config.json, the
    offending value and the supported ones for an unknown ``quant_method``, an unsupported compressed-tensors
    format, strategy or status, a static FP8 activation scheme, or a malformed block size."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_format(qc)
    if method == "mxfp4":
        return SourceFormat("mxfp4", ignore=tuple(qc.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _ct_format(qc)
    raise _refuse("quant_method", method, SUPPORTED_METHODS)


def _fp8_format(qc: dict) -> SourceFormat:
    block = qc.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0
                                                                          for b in block):
        raise ValueError(
            f"config.json: quantization_config.weight_block_size is {block!r}; fp8 checkpoints are read only with "
            "block scales, two positive integers such as [128, 128]"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse("activation_scheme", scheme, ("dynamic",))
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in FP8_SCALE_FORMATS:
        raise _refuse("scale_fmt", scale_fmt, FP8_SCALE_FORMATS)
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fmt", fmt, ("e4m3",))
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return SourceFormat("fp8_block", block_size=(block[0], block[1]), scale_fmt=scale_fmt, ignore=tuple(ignore))


def _ct_format(qc: dict) -> SourceFormat:
    top = qc.get("format")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, ("compressed",))
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("config.json: quantization_config.config_groups is empty; compressed-tensors needs a group")
    schemes = tuple(_ct_scheme(f"config_groups.{name}", group, top) for name, group in groups.items())
    name = "pack_quantized" if all(s.format == "pack-quantized" for s in schemes) else "compressed_tensors"
    return SourceFormat(name, schemes=schemes, ignore=tuple(qc.get("ignore") or ()))


def _ct_scheme(where: str, group: dict, top: str | None) -> PackScheme:
    gfmt = group.get("format") or top
    if gfmt not in CT_FORMATS:
        raise _refuse(f"{where}.format", gfmt, CT_FORMATS)
    if group.get("output_activations") is not None:
        raise ValueError(f"config.json: quantization_config.{where}.output_activations is set; not read")
    act = group.get("input_activations")
    if act is not None and not act.get("dynamic"):
        raise ValueError(
            f"config.json: quantization_config.{where}.input_activations is static (stored input scales); only "
            "weight-only or dynamic-activation checkpoints are read"
        )
    w = group.get("weights") or {}
    kinds = ("int",) if gfmt in ("pack-quantized", "int-quantized") else ("float",) if gfmt == "float-quantized" \
        else ("int", "float")
    wtype = w.get("type", "int")
    if wtype not in kinds:
        raise _refuse(f"{where}.weights.type", wtype, kinds)
    bits = w.get("num_bits")
    allowed_bits = range(1, 9) if gfmt == "pack-quantized" else (8,)
    if bits not in allowed_bits:
        raise _refuse(f"{where}.weights.num_bits", bits, allowed_bits)
    strategy = w.get("strategy")
    strategies = PACK_STRATEGIES if gfmt == "pack-quantized" else BYTE_STRATEGIES
    if strategy not in strategies:
        raise _refuse(f"{where}.weights.strategy", strategy, strategies)
    group_size = w.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise ValueError(
            f"config.json: quantization_config.{where}.weights.group_size is {group_size!r}; the group "
            "strategy needs a positive integer"
        )
    block = w.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2
                                    and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"config.json: quantization_config.{where}.weights.block_structure is {block!r}; the block strategy "
            "needs two positive integers"
        )
    targets = tuple(group.get("targets") or ())
    for t in targets:
        if t.startswith("re:"):
            re.compile(t[3:])
    return PackScheme(targets, bits, bool(w.get("symmetric", True)), strategy,
                      group_size if strategy == "group" else None, format=gfmt, type=wtype,
                      block=tuple(block) if strategy == "block" else None)


def pack_scheme(fmt: SourceFormat, module: str) -> PackScheme | None:
    """The config group whose targets cover ``module``: a ``re:`` regex or exact-name target first, else a group
    targeting a class name (such as ``"Linear"``) or nothing in particular (no targets). None when no group
    applies; ValueError when several do."""
    by_name = [s for s in fmt.schemes if any(_is_name_target(t) and _ct_match(module, t) for t in s.targets)]
    chosen = by_name or [s for s in fmt.schemes
                         if not s.targets or any(not _is_name_target(t) for t in s.targets)]
    if len(chosen) > 1:
        raise ValueError(
            f"config.json: {len(chosen)} config_groups of quantization_config apply to module {module!r}; "
            "at most one may"
        )
    return chosen[0] if chosen else None


def _is_name_target(target: str) -> bool:
    return target.startswith("re:") or "." in target
