"""The source format of a checkpoint, read from ``config.json``'s ``quantization_config``.

Supported: ``quant_method: "fp8"`` with ``weight_block_size`` (DeepSeek-V3/R1, Kimi-K2, Qwen3 and GLM ``-FP8``
releases), ``quant_method: "mxfp4"`` (gpt-oss experts) and ``quant_method: "compressed-tensors"`` with
``format: "pack-quantized"`` integer weights (Kimi-K2-Thinking and other llm-compressor releases). Anything else is
refused with an error naming config.json, the value found and the supported values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED_METHODS = ("fp8", "mxfp4", "compressed-tensors")
FP8_SCALE_FORMATS = ("float", "ue8m0")
PACK_STRATEGIES = ("group", "channel")


@dataclass(frozen=True)
class PackScheme:
    """One compressed-tensors config group of integer weights.

    targets: the group's ``targets`` (``"re:"`` regexes, exact module names, or class names such as ``"Linear"``);
    num_bits 1..8; symmetric (False: a packed ``weight_zero_point`` is stored); strategy ``"group"`` or
    ``"channel"``; group_size (``None`` for channel)."""

    targets: tuple[str, ...]
    num_bits: int
    symmetric: bool
    strategy: str
    group_size: int | None


@dataclass(frozen=True)
class SourceFormat:
    """How a checkpoint's weights are stored.

    name: ``"fp8_block"``, ``"mxfp4"`` or ``"pack_quantized"``.
    block_size: (rows, cols) of one FP8 scale block (fp8_block only).
    scale_fmt: ``"float"`` or ``"ue8m0"`` (power-of-two scales; fp8_block only).
    schemes: the integer config groups (pack_quantized only).
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
        if self.name == "pack_quantized":
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
        return _pack_format(qc)
    raise _refuse("quant_method", method, SUPPORTED_METHODS)


def _fp8_format(qc: dict) -> SourceFormat:
    block = qc.get("weight_block_size")
    if block is None or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
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


def _pack_format(qc: dict) -> SourceFormat:
    top = qc.get("format")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, ("compressed",))
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("config.json: quantization_config.config_groups is empty; pack-quantized needs one group")
    schemes = []
    for gname, group in groups.items():
        where = f"config_groups.{gname}"
        gfmt = group.get("format") or top
        if gfmt != "pack-quantized":
            raise _refuse(f"{where}.format", gfmt, ("pack-quantized",))
        for act in ("input_activations", "output_activations"):
            if group.get(act) is not None:
                raise ValueError(
                    f"config.json: quantization_config.{where}.{act} is set; only weight-only pack-quantized "
                    "checkpoints are read"
                )
        w = group.get("weights") or {}
        if w.get("type", "int") != "int":
            raise _refuse(f"{where}.weights.type", w.get("type"), ("int",))
        bits = w.get("num_bits")
        if not isinstance(bits, int) or not 1 <= bits <= 8:
            raise _refuse(f"{where}.weights.num_bits", bits, range(1, 9))
        strategy = w.get("strategy")
        if strategy not in PACK_STRATEGIES:
            raise _refuse(f"{where}.weights.strategy", strategy, PACK_STRATEGIES)
        group_size = w.get("group_size")
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise ValueError(
                f"config.json: quantization_config.{where}.weights.group_size is {group_size!r}; the group "
                "strategy needs a positive integer"
            )
        targets = tuple(group.get("targets") or ())
        for t in targets:
            if t.startswith("re:"):
                re.compile(t[3:])
        schemes.append(
            PackScheme(targets, bits, bool(w.get("symmetric", True)), strategy,
                       group_size if strategy == "group" else None)
        )
    return SourceFormat("pack_quantized", schemes=tuple(schemes), ignore=tuple(qc.get("ignore") or ()))


def pack_scheme(fmt: SourceFormat, module: str) -> PackScheme:
    """The config group whose targets cover ``module``: a ``re:`` regex or exact-name target first, else a group
    targeting a class name (such as ``"Linear"``); exactly one must apply."""
    if len(fmt.schemes) == 1:
        return fmt.schemes[0]
    by_name = [s for s in fmt.schemes if any(_is_name_target(t) and _ct_match(module, t) for t in s.targets)]
    chosen = by_name or [s for s in fmt.schemes if any(not _is_name_target(t) for t in s.targets)]
    if len(chosen) != 1:
        raise ValueError(
            f"config.json: {len(chosen)} config_groups of quantization_config apply to module {module!r}; "
            "exactly one must"
        )
    return chosen[0]


def _is_name_target(target: str) -> bool:
    return target.startswith("re:") or "." in target
