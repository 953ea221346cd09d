"""How one weight matrix is quantized: :class:`QuantConfig` (re-exported by :mod:`jgptq.config`).

It is frozen and hashable, so jitted functions take it as a static argument. Every field is checked at
construction with an error that names the field and the rule; the fields the ``jgptq`` command exposes declare
their options (:mod:`jgptq.options`).
"""

from __future__ import annotations

import dataclasses

from jgptq.options import flag

# The values a field may take (the command line offers the same choices).
ACT_ORDERS = ("none", "desc", "static", "group_aware")
AUTO_ORDER = "auto"   # QuantConfig's default act_order: "static" on integer grids, "none" for GGML formats
SCALE_DTYPES = ("float16", "bfloat16", "float32")


def _fail(field: str, value, rule: str):
    raise ValueError(f"QuantConfig.{field}={value!r}: {rule}")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How a weight matrix W (out_features x in_features) is quantized by GPTQ.

    Attributes:
      format: ``"int"`` for uniform integer grids, or a GGML format name (``"q4_k"``, ``"iq2_xxs"``, ...), in
        which case each format block of a row is encoded jointly (GPTQ group update).
      bits: integer grid width, 2..8 (``format="int"`` only).
      group_size: input columns sharing one scale/zero; ``-1`` = one grid per output row (per channel).
      sym: symmetric grid (zero point fixed at the middle code) or asymmetric (zero fitted per group).
      act_order: column order of the solve: ``"none"`` (natural), ``"desc"`` (by descending Hessian diagonal,
        groups formed in that order: non-monotonic g_idx), ``"static"`` (descending order, groups fixed on the
        original order with grids precomputed from the original weight, as llm-compressor), ``"group_aware"``
        (GAR: columns sorted inside each group, groups ordered by their largest diagonal; g_idx stays monotonic).
        The default ``"auto"`` is ``"static"`` for integer grids and ``"none"`` for GGML formats (which encode
        blocks of consecutive columns), resolved at construction: the field holds the order the solve uses, and
        :meth:`replace` resolves it again for a changed format unless an order is given.
      static_groups: fit every group's grid once from the original weight instead of lazily from the
        error-updated weight when the solve reaches the group.
      block_size: columns per lazy block update (rounded up to a multiple of the group size).
      damp: relative damping: ``damp * mean(diag(H))`` is added to the diagonal before the Cholesky factor.
      mse: 0 for min/max grids; > 0 searches a clipping factor per group minimising the p-norm error with
        ``p = mse`` (2.4 is customary).
      mse_grid, mse_maxshrink: the clip search tries ``1 - i / mse_grid`` for ``i < mse_maxshrink * mse_grid``.
      zero_dead_columns: columns whose Hessian diagonal is zero (no calibration input) are set to zero in W, as
        the reference implementations do; False keeps them (they are then rounded to nearest).
      scale_dtype: the dtype grid scales are stored in by exporters (GPTQ checkpoints store float16, compressed
        tensors the model dtype). Scales are rounded to it when fitted, so the solve already works with the
        stored values and exported files decode to exactly the solver's weights. ``"float32"`` keeps full scales.
    """

    format: str = dataclasses.field(default="int", metadata=flag(
        "--format", "weight format: 'int' (integer grids, for gptq and compressed-tensors) or a GGML format such as "
        "q4_k (for --export gguf) (default: {default})"))
    bits: int = dataclasses.field(default=4, metadata=flag(
        "--bits", "bits per weight, 2..8 (default: {default})", type=int))
    group_size: int = dataclasses.field(default=128, metadata=flag(
        "--group-size", "input columns per scale; -1 = one per output row (default: {default})", type=int))
    sym: bool = dataclasses.field(default=True, metadata=flag(
        "--sym", "symmetric grids, zero point in the middle", off="--asym",
        off_help="asymmetric grids, a zero point per group"))
    act_order: str = dataclasses.field(default=AUTO_ORDER, metadata=flag(
        "--act-order", "column order of the solve; the bare flag means group_aware, which every exporter holds "
        "('desc' with groups: gptq only) (default: {default}: static on integer grids, none for GGML formats)",
        nargs="?", const="group_aware", choices=(AUTO_ORDER,) + ACT_ORDERS))
    static_groups: bool = False
    block_size: int = 128
    damp: float = dataclasses.field(default=0.01, metadata=flag(
        "--damp", "relative Hessian damping (default: {default})", type=float))
    mse: float = 0.0
    mse_grid: int = 100
    mse_maxshrink: float = 0.8
    zero_dead_columns: bool = True
    scale_dtype: str = "float16"

    def __post_init__(self):
        if not isinstance(self.format, str) or not self.format:
            _fail("format", self.format, "must be 'int' or a GGML format name")
        object.__setattr__(self, "format", self.format.lower())
        if self.act_order == AUTO_ORDER:
            object.__setattr__(self, "act_order", "static" if self.format == "int" else "none")
            object.__setattr__(self, "_auto_order", True)   # not a field: equal and hashed as the resolved order
        if self.format != "int":
            from jgptq.ggml.registry import get_format

            try:
                get_format(self.format)
            except ValueError as exc:
                _fail("format", self.format, str(exc))
            if self.act_order != "none":
                _fail("act_order", self.act_order, "GGML formats encode blocks of consecutive columns; "
                      "only 'none' is possible")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            _fail("bits", self.bits, "must be an integer in 2..8")
        if not isinstance(self.group_size, int) or (self.group_size != -1 and self.group_size < 1):
            _fail("group_size", self.group_size, "must be -1 (per channel) or a positive integer")
        if self.act_order not in ACT_ORDERS:
            _fail("act_order", self.act_order, f"must be one of {ACT_ORDERS}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            _fail("block_size", self.block_size, "must be a positive integer")
        if not 0.0 < float(self.damp) < 1.0:
            _fail("damp", self.damp, "must lie in (0, 1)")
        if float(self.mse) < 0.0:
            _fail("mse", self.mse, "must be 0 (off) or a positive norm exponent")
        if not isinstance(self.mse_grid, int) or self.mse_grid < 1:
            _fail("mse_grid", self.mse_grid, "must be a positive integer")
        if self.scale_dtype not in SCALE_DTYPES:
            _fail("scale_dtype", self.scale_dtype, f"must be one of {SCALE_DTYPES}")
        if not 0.0 < float(self.mse_maxshrink) < 1.0:
            _fail("mse_maxshrink", self.mse_maxshrink, "must lie in (0, 1)")

    @property
    def maxq(self) -> int:
        """Largest integer code, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def is_ggml(self) -> bool:
        return self.format != "int"

    def replace(self, **changes) -> QuantConfig:
        """A copy with some fields changed (validated again); an ``act_order`` left at its default is resolved
        again for the copy's format."""
        if self.__dict__.get("_auto_order") and "act_order" not in changes:
            changes["act_order"] = AUTO_ORDER
        return dataclasses.replace(self, **changes)
