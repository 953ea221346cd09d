"""The exporters' input: one quantized weight matrix (or a stack of them) as plain numpy arrays.

A :class:`QuantizedWeight` holds what every integer-grid checkpoint format is made of: integer codes, one scale and
zero point per row and group, and the group of every input column (``g_idx``). The weight it stands for is

    W[..., r, c] = scales[..., r, g_idx[..., c]] * (codes[..., r, c] - zeros[..., r, g_idx[..., c]])

computed in float32 (:meth:`QuantizedWeight.dequantize`), which is exactly what :func:`jgptq.gptq.solve` returned
as ``result.weight``. Leading axes (a stack of experts) are allowed; index a stack to get one expert.

Example::

    import jax.numpy as jnp
    from jgptq import QuantConfig
    from jgptq.gptq import solve
    from jgptq.export import QuantizedWeight

    config = QuantConfig(bits=4, group_size=32, act_order="desc")
    result = solve(w, h, config)                    # w (out, in), h (in, in)
    record = QuantizedWeight.from_result(result, config)
    assert (record.dequantize() == np.asarray(result.weight)).all()
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jgptq.config import ACT_ORDERS, SCALE_DTYPES
from jgptq.methods import registry as methods


def record_methods() -> tuple:
    """What a record's ``method`` may say: a registered method's name, or ``"mixed"`` for a stack holding
    several."""
    return methods.names() + ("mixed",)


def _fail(name: str, rule: str):
    raise ValueError(f"QuantizedWeight {name}: {rule}")


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """Integer codes and their grids for a weight (..., R, C) = (..., out_features, in_features).

    Attributes:
      codes: uint8 (..., R, C), integer codes in [0, 2**bits - 1], original column order.
      scales: float32 (..., R, G), grid scales (positive, finite).
      zeros: uint8 (..., R, G), integer zero points in [0, 2**bits - 1]; ``2**(bits-1)`` everywhere when ``sym``.
      g_idx: int32 (..., C), the group of every input column, in [0, G).
      bits: code width, 1..8.
      group_size: input columns per group, or -1 (one grid per row, G = 1).
      sym: symmetric grids (zero point fixed at ``2**(bits-1)``).
      act_order: the column order the solve used (``"none"``, ``"desc"``, ``"static"``, ``"group_aware"``);
        informational, except that only ``"desc"`` can give a ``g_idx`` other than ``column // group_size``.
      scale_dtype: the dtype the scales are meant to be stored in (``"float16"``, ``"bfloat16"``,
        ``"float32"``); their values must be exactly representable in it.
      method: how the codes were found: ``"gptq"``, ``"rtn"`` (round-to-nearest: a baseline run, or an expert
        with too few calibration tokens) or ``"mixed"`` (a stack holding both); informational.
      transposed: the checkpoint stores this tensor with its last two axes swapped, (..., in, out) (the fused
        experts of some families); the arrays here are always in (..., out, in) orientation.

    Arrays are converted to the dtypes above (values are checked, never wrapped; an array already of its dtype is
    not copied) and exposed read-only. :meth:`take` (and indexing, :meth:`rows`) gives parts without copies.
    """

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    g_idx: np.ndarray
    bits: int
    group_size: int
    sym: bool
    act_order: str = "none"
    scale_dtype: str = "float32"
    method: str = "gptq"
    transposed: bool = False

    def __post_init__(self):
        bits = self.bits
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
            _fail("bits", f"{bits!r} is not an integer in 1..8 (int32 packing holds at most 8-bit codes)")
        object.__setattr__(self, "bits", int(bits))
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, (int, np.integer)) or (gs != -1 and gs < 1):
            _fail("group_size", f"{gs!r} must be -1 (per channel) or a positive integer")
        object.__setattr__(self, "group_size", int(gs))
        object.__setattr__(self, "sym", bool(self.sym))
        if self.act_order not in ACT_ORDERS:
            _fail("act_order", f"{self.act_order!r} is not one of {ACT_ORDERS}")
        if self.scale_dtype not in SCALE_DTYPES:
            _fail("scale_dtype", f"{self.scale_dtype!r} is not one of {SCALE_DTYPES}")
        if self.method not in record_methods():
            _fail("method", f"{self.method!r} is not one of {record_methods()}")
        object.__setattr__(self, "transposed", bool(self.transposed))
        maxq = (1 << self.bits) - 1

        codes = _integers("codes", self.codes, 0, maxq, np.uint8)
        zeros = _integers("zeros", self.zeros, 0, maxq, np.uint8)
        scales = np.asarray(self.scales)
        if scales.dtype.kind != "f":
            _fail("scales", f"must be floating point, got {scales.dtype}")
        scales = scales.astype(np.float32, copy=False)
        if codes.ndim < 2:
            _fail("codes", f"must be (..., out, in), got shape {codes.shape}")
        lead, (rows, cols) = codes.shape[:-2], codes.shape[-2:]
        num_groups = 1 if self.group_size == -1 else -(-cols // self.group_size)
        if scales.shape != lead + (rows, num_groups):
            _fail("scales", f"shape {scales.shape} does not match codes {codes.shape} with group_size "
                  f"{self.group_size} (expected {lead + (rows, num_groups)})")
        if zeros.shape != scales.shape:
            _fail("zeros", f"shape {zeros.shape} differs from scales {scales.shape}")
        if not np.all(np.isfinite(scales)) or not np.all(scales > 0):
            _fail("scales", "must be finite and positive")
        g_idx = _integers("g_idx", self.g_idx, 0, num_groups - 1, np.int32)
        if g_idx.shape != lead + (cols,):
            _fail("g_idx", f"shape {g_idx.shape} does not match {cols} input columns (expected {lead + (cols,)})")
        if self.sym and np.any(zeros != (1 << (self.bits - 1))):
            _fail("zeros", f"a symmetric grid has every zero point at {1 << (self.bits - 1)}")
        if self.scale_dtype != "float32" and not _representable(scales, self.scale_dtype):
            _fail("scales", f"values are not exactly representable in scale_dtype {self.scale_dtype!r}")
        for name, arr in (("codes", codes), ("scales", scales), ("zeros", zeros), ("g_idx", g_idx)):
            object.__setattr__(self, name, _readonly(arr))

    @classmethod
    def from_result(cls, result, config) -> "QuantizedWeight":
        """The record of a :class:`jgptq.gptq.GPTQResult` solved with ``config`` (a :class:`QuantConfig`).

        Works on single results and on :func:`jgptq.gptq.solve_experts` stacks (leading expert axis).
        """
        if getattr(config, "is_ggml", False) or result.codes is None:
            raise ValueError("QuantizedWeight.from_result: the result holds GGML blocks, not integer-grid codes; "
                             "GGML formats are written by the GGUF exporter")
        zeros = np.asarray(result.zeros, np.float32)
        if not np.all(zeros == np.round(zeros)):
            raise ValueError("QuantizedWeight.from_result: zero points are not integers")
        return cls(codes=np.asarray(result.codes), scales=np.asarray(result.scales, np.float32),
                   zeros=zeros.astype(np.int64), g_idx=np.asarray(result.g_idx), bits=config.bits,
                   group_size=config.group_size, sym=config.sym, act_order=config.act_order,
                   scale_dtype=config.scale_dtype)

    # --- shape facts -------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple:
        """The weight's shape (..., out_features, in_features)."""
        return self.codes.shape

    @property
    def num_groups(self) -> int:
        return self.scales.shape[-1]

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def plain_g_idx(self) -> np.ndarray:
        """int32 (C,): the group of each column without act-order, ``column // group_size`` (zeros per channel)."""
        cols = self.shape[-1]
        if self.group_size == -1:
            return np.zeros(cols, np.int32)
        return (np.arange(cols) // self.group_size).astype(np.int32)

    def has_plain_g_idx(self) -> bool:
        """True when every column's group is ``column // group_size`` (no gather at inference)."""
        return bool(np.all(self.g_idx == self.plain_g_idx()))

    # --- values -----------------------------------------------------------------------------------------------
    def dequantize(self) -> np.ndarray:
        """float32 (..., R, C): ``scales[..., g_idx] * (codes - zeros[..., g_idx])``."""
        idx = np.broadcast_to(self.g_idx[..., None, :], self.shape).astype(np.intp)
        scale = np.take_along_axis(self.scales, idx, axis=-1)
        zero = np.take_along_axis(self.zeros, idx, axis=-1).astype(np.float32)
        return scale * (self.codes.astype(np.float32) - zero)

    # --- slicing ----------------------------------------------------------------------------------------------
    def take(self, index=None, rows=None, *, method: str = None) -> "QuantizedWeight":
        """Entry ``index`` of the leading (expert) axis (None: every entry) and output ``rows`` (a slice or an
        integer array; None: every row), with ``method`` in place of this record's when given. The parts share
        this record's memory where numpy indexing allows (slices) and are not checked again."""
        codes, scales, zeros, g_idx = self.codes, self.scales, self.zeros, self.g_idx
        if index is not None:
            if codes.ndim == 2:
                raise IndexError("QuantizedWeight: a single matrix has no leading axis to index (use .rows for rows)")
            codes, scales, zeros, g_idx = codes[index], scales[index], zeros[index], g_idx[index]
        if rows is not None:
            sl = (Ellipsis, rows, slice(None))
            codes, scales, zeros = codes[sl], scales[sl], zeros[sl]
        return _derived(self, codes=codes, scales=scales, zeros=zeros, g_idx=g_idx,
                        method=self.method if method is None else method)

    def __getitem__(self, index) -> "QuantizedWeight":
        """One entry of the leading (expert) axes, e.g. ``stack[e]``; rows and columns stay whole."""
        return self.take(index)

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Output rows ``start:stop`` (e.g. the gate or the up half of a fused gate_up projection)."""
        rows = self.shape[-2]
        if not 0 <= start < stop <= rows:
            raise ValueError(f"QuantizedWeight.rows: [{start}, {stop}) is not a row range of {rows} rows")
        return self.take(rows=slice(start, stop))

    def __repr__(self) -> str:
        return (f"QuantizedWeight(shape={self.shape}, bits={self.bits}, group_size={self.group_size}, "
                f"sym={self.sym}, act_order={self.act_order!r}, scale_dtype={self.scale_dtype!r}, "
                f"method={self.method!r})")


@dataclasses.dataclass(frozen=True, eq=False)
class GGMLWeight:
    """GGML blocks of a weight (..., R, C) = (..., out_features, in_features), as llama.cpp stores them.

    Every output row is ``C // block_size`` consecutive blocks of the format; the bytes are exactly what the
    solver chose (re-encoding the decoded weight would not reproduce them), so :meth:`dequantize` gives back the
    weight the model was left with, bit for bit.

    Attributes:
      payload: uint8 (..., R, C // block_size, type_size).
      format: the GGML format name (``"q4_k"``, ``"iq2_xxs"``, ...; see :func:`jgptq.ggml.get_format`).
      method: ``"gptq"``, ``"rtn"`` (plain encoding with importance: a baseline, or an expert with too few
        calibration tokens) or ``"mixed"``; informational.
      transposed: the checkpoint stores this tensor as (..., in, out); the payload is always (..., out, in).
    """

    payload: np.ndarray
    format: str
    method: str = "gptq"
    transposed: bool = False

    def __post_init__(self):
        from jgptq.ggml.registry import get_format

        fmt = get_format(self.format)  # raises on an unknown name
        object.__setattr__(self, "format", fmt.name)
        if self.method not in record_methods():
            raise ValueError(f"GGMLWeight method: {self.method!r} is not one of {record_methods()}")
        object.__setattr__(self, "transposed", bool(self.transposed))
        payload = np.asarray(self.payload)
        if payload.dtype != np.uint8:
            raise ValueError(f"GGMLWeight payload: must be uint8 bytes, got {payload.dtype}")
        if payload.ndim < 3 or payload.shape[-1] != fmt.type_size:
            raise ValueError(f"GGMLWeight payload: expected (..., rows, blocks, {fmt.type_size}) for {fmt.name}, "
                             f"got shape {payload.shape}")
        object.__setattr__(self, "payload", _readonly(payload))

    @property
    def block_size(self) -> int:
        from jgptq.ggml.registry import get_format

        return get_format(self.format).block_size

    @property
    def shape(self) -> tuple:
        """The weight's shape (..., out_features, in_features)."""
        return self.payload.shape[:-2] + (self.payload.shape[-2] * self.block_size,)

    def row_bytes(self) -> np.ndarray:
        """uint8 (..., R, C // block_size * type_size): each row's blocks back to back (llama.cpp's row layout)."""
        return self.payload.reshape(self.payload.shape[:-2] + (-1,))

    def dequantize(self) -> np.ndarray:
        """float32 (..., R, C), decoded exactly as llama.cpp's ``dequantize_row_*``."""
        from jgptq.ggml.api import decode

        return np.asarray(decode(self.row_bytes(), self.format))

    def take(self, index=None, rows=None, *, method: str = None) -> "GGMLWeight":
        """Entry ``index`` of the leading (expert) axis (None: every entry) and output ``rows`` (a slice or an
        integer array; None: every row), with ``method`` in place of this record's when given; as
        :meth:`QuantizedWeight.take`."""
        payload = self.payload
        if index is not None:
            if payload.ndim == 3:
                raise IndexError("GGMLWeight: a single matrix has no leading axis to index (use .rows for rows)")
            payload = payload[index]
        if rows is not None:
            payload = payload[..., rows, :, :]
        return _derived(self, payload=payload, method=self.method if method is None else method)

    def __getitem__(self, index) -> "GGMLWeight":
        """One entry of the leading (expert) axes, e.g. ``stack[e]``."""
        return self.take(index)

    def rows(self, start: int, stop: int) -> "GGMLWeight":
        """Output rows ``start:stop`` (e.g. the gate or the up half of a fused gate_up projection)."""
        rows = self.payload.shape[-3]
        if not 0 <= start < stop <= rows:
            raise ValueError(f"GGMLWeight.rows: [{start}, {stop}) is not a row range of {rows} rows")
        return self.take(rows=slice(start, stop))

    def __repr__(self) -> str:
        return f"GGMLWeight(shape={self.shape}, format={self.format!r}, method={self.method!r})"


def expert_entries(stack: QuantizedWeight, templates: str | Sequence[str], *, start: int = 0):
    """Per-expert (name, record) pairs of a fused expert stack, as per-expert checkpoints name them.

    Args:
      stack: a record (:class:`QuantizedWeight` or :class:`GGMLWeight`) with a leading expert axis, (E, R, C).
      templates: a name with an ``{expert}`` field, e.g. ``"model.layers.3.mlp.experts.{expert}.down_proj"``; or
        several, which split the rows evenly in order, e.g. the fused gate_up stack (E, 2I, H) of the default
        layout with ``["...experts.{expert}.gate_proj", "...experts.{expert}.up_proj"]``.
      start: the index of the first expert in the stack (for stacks holding a slice of the experts).
    Yields:
      (name, QuantizedWeight (R / len(templates), C)) for every expert and template.
    """
    if len(stack.shape) != 3:
        raise ValueError(f"expert_entries: expected a stack of shape (experts, out, in), got {stack.shape}")
    names = [templates] if isinstance(templates, str) else list(templates)
    if not names or any("{expert}" not in t for t in names):
        raise ValueError(f"expert_entries: every template needs an '{{expert}}' field, got {names}")
    rows = stack.shape[1]
    if rows % len(names):
        raise ValueError(f"expert_entries: {rows} rows do not split evenly into {len(names)} projections")
    part = rows // len(names)
    for e in range(stack.shape[0]):
        one = stack[e]
        for k, template in enumerate(names):
            yield template.format(expert=start + e), one if len(names) == 1 else one.rows(k * part, (k + 1) * part)


def _integers(name: str, values, lo: int, hi: int, dtype) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            _fail(name, "must hold integers")
    elif arr.dtype.kind not in "iub":
        _fail(name, f"must be an integer array, got {arr.dtype}")
    if arr.size and (arr.min() < lo or arr.max() > hi):
        _fail(name, f"values must lie in [{lo}, {hi}], found [{arr.min()}, {arr.max()}]")
    return arr.astype(dtype, copy=False)


def _readonly(arr: np.ndarray) -> np.ndarray:
    """``arr`` exposed read-only: a read-only view where ``arr`` itself is writeable (the caller's array stays
    as it was), ``arr`` where it already is read-only."""
    if arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr


def _derived(record, **fields):
    """A checked record with some fields replaced by parts of its own arrays (an expert, some rows), made without
    checking or copying again: parts of valid arrays are valid."""
    if "method" in fields and fields["method"] not in record_methods():
        raise ValueError(f"{type(record).__name__} method: {fields['method']!r} is not one of {record_methods()}")
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    new.__dict__.update({k: _readonly(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()})
    return new


def _representable(values: np.ndarray, scale_dtype: str) -> bool:
    """True when every float32 value survives a round trip through ``scale_dtype`` unchanged."""
    return bool(np.all(values.astype(storage_dtype(scale_dtype)).astype(np.float32) == values))


def storage_dtype(scale_dtype: str) -> np.dtype:
    """The numpy dtype of a scale dtype name (bfloat16 through ml_dtypes)."""
    if scale_dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(scale_dtype)
