"""Frozen, validated configuration objects.

:class:`QuantConfig` says how one weight matrix is quantized; it is hashable, so jitted functions take it as a
static argument. Every field is checked at construction with an error that names the field and the rule.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jgptq.run_fields import OFFLOADS, check_run_fields, parse_size  # noqa: F401
from jgptq.run_fields import fail_in as _fail_in

# The values a field may take (the command line offers the same choices).
ACT_ORDERS = ("none", "desc", "static", "group_aware")
AUTO_ORDER = "auto"   # QuantConfig's default act_order: "static" on integer grids, "none" for GGML formats
SCALE_DTYPES = ("float16", "bfloat16", "float32")
MOE_CALIBRATIONS = ("routed", "all_experts")
ROUTER_WEIGHTINGS = {"none": 0.0, "linear": 1.0, "squared": 2.0}   # name -> power of the routing weight
HESSIAN_DTYPES = ("float32", "bfloat16")
IMPORTANCES = ("imatrix", "hessian", "none")
IMATRIX_SOURCES = ("replay", "float")


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

    format: str = "int"
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: str = AUTO_ORDER
    static_groups: bool = False
    block_size: int = 128
    damp: float = 0.01
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

    def replace(self, **changes) -> "QuantConfig":
        """A copy with some fields changed (validated again); an ``act_order`` left at its default is resolved
        again for the copy's format."""
        if self.__dict__.get("_auto_order") and "act_order" not in changes:
            changes["act_order"] = AUTO_ORDER
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How the experts of a Mixture-of-Experts layer are calibrated.

    Attributes:
      calibration: ``"routed"`` (each expert's Hessian from the tokens the router sends it) or ``"all_experts"``
        (every expert's Hessian from every token; the layer output, hence the next layer's input, stays exactly
        the routed one). With ``all_experts`` the gate/up projections of all experts share one Hessian.
      min_tokens: an expert whose Hessian saw fewer tokens than ``max(min_tokens, min_token_fraction * N)``
        (N = the layer's calibration tokens) is quantized by round-to-nearest instead of GPTQ, with a warning
        and a line in the report. At least 1: an expert never routed to has no Hessian at all.
      min_token_fraction: see ``min_tokens`` (0 disables the relative threshold).
      router_weighting: how a routed token's rows count in its expert's Hessians: ``"none"`` (each token once),
        ``"linear"`` (times the routing weight ``p`` the expert's output is multiplied by) or ``"squared"``
        (times ``p**2``: the expert's share of the layer output's squared error, ``||p (W - Q) x||^2``). Token
        counts and the importance statistic are unweighted. Experts whose inputs arrive already multiplied by
        the routing score (Llama 4's) have an output multiplier of 1, so their Hessians are unchanged. Routed
        calibration only (an unrouted token's weight is 0).
    """

    calibration: str = "routed"
    min_tokens: int = 1
    min_token_fraction: float = 0.0
    router_weighting: str = "none"

    def __post_init__(self):
        if self.calibration not in MOE_CALIBRATIONS:
            _fail_in("MoEConfig", "calibration", self.calibration, f"must be one of {MOE_CALIBRATIONS}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            _fail_in("MoEConfig", "min_tokens", self.min_tokens, "must be an integer >= 1")
        if not 0.0 <= float(self.min_token_fraction) < 1.0:
            _fail_in("MoEConfig", "min_token_fraction", self.min_token_fraction, "must lie in [0, 1)")
        if self.router_weighting not in ROUTER_WEIGHTINGS:
            _fail_in("MoEConfig", "router_weighting", self.router_weighting,
                     f"must be one of {tuple(ROUTER_WEIGHTINGS)}")
        if self.router_weighting != "none" and self.calibration == "all_experts":
            _fail_in("MoEConfig", "router_weighting", self.router_weighting, "weights routed tokens by the routing "
                     "weight, which is 0 for the tokens all_experts calibration adds; use calibration='routed'")

    @property
    def router_power(self) -> float:
        """The power of the routing weight each routed row is weighted by in the Hessians (0: unweighted)."""
        return ROUTER_WEIGHTINGS[self.router_weighting]

    def threshold(self, layer_tokens: int) -> int:
        """Smallest token count for which an expert is solved by GPTQ."""
        return max(self.min_tokens, math.ceil(self.min_token_fraction * layer_tokens))


# The metadata of a field that says where or how visibly a run works, never what it computes (:data:`RUN_FIELDS`).
_WHERE = {"where": True}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The layer-by-layer quantization of a whole model (:func:`jgptq.quantize_moe`).

    Attributes:
      quant: how each weight matrix is quantized (:class:`QuantConfig`).
      moe: how experts are calibrated (:class:`MoEConfig`).
      method: ``"gptq"``, or ``"rtn"`` (round-to-nearest on the same grids, no calibration solve: a baseline).
      hessian_dtype: ``"float32"`` (exact float32 X^T X) or ``"bfloat16"`` (bf16 operands, float32 sums).
      batch_size: calibration sequences per forward.
      max_length: truncate tokenized text to this many tokens (None: no truncation).
      exclude: extra regular expressions; a module whose name (relative to its decoder layer, e.g.
        ``self_attn.o_proj`` or ``mlp.experts``) matches one is left in floating point. Routers, embeddings and
        the output head are always excluded.
      keep_hessians: keep every finalized Hessian in the result (memory: C^2 floats each), for analysis.
      progress: show progress bars.
      offload: where decoder layers live while others are processed (:mod:`jgptq_torch.pipeline.offload`): ``"none"`` (where
        they are; a layer not on the run device visits it while processed), ``"cpu"`` (in host memory, one at a
        time on the device) or ``"disk"`` (in one safetensors file per layer; host memory holds one layer).
      offload_dir: the folder of the layer files (``offload="disk"``; default: a temporary folder).
      device_budget: bytes (or ``"40GB"``) the run may place on the device; checked against an estimate of each
        layer's need before any work (None: no check). The peak is recorded in ``report.memory``.
      reload: ``offload="disk"``: load every layer back into host memory at the end. False leaves the returned
        model's layers on the meta device, their quantized tensors in ``offload_dir``
        (:func:`jgptq.reload_all` loads them).
      keep_offload_files: ``offload="disk"``: keep the layer files after reloading.
      importance: per-column importance handed to the GGML encoders (GGML formats only): ``"imatrix"`` (llama.cpp's
        statistic, the mean of squared inputs over the tokens each weight saw, routed tokens only for experts:
        the scale llama.cpp's encoders expect), ``"hessian"`` (the Hessian diagonal, twice that) or ``"none"``
        (the encoders' unweighted path; refused for formats llama.cpp will not make without importance:
        ``jgptq.mixes.NEEDS_IMPORTANCE``). An imatrix given to :func:`jgptq.quantize_moe` replaces the collected
        one.
      imatrix_source: the inputs the importance statistic (``result.imatrix``, the ``"imatrix"`` importance) is
        collected on: ``"replay"`` (each layer's inputs in this run, where the earlier layers are already
        quantized: the inputs GPTQ's Hessians see) or ``"float"`` (the inputs each layer gets when every earlier
        layer is float, llama.cpp's definition). ``"float"`` carries a second stream of hidden states through the
        float layers: one more forward of each layer per batch (the first layer's is shared with its calibration)
        and one more set of a layer's hidden states in memory.
      formats: per-weight GGML formats: ``((regex, format), ...)`` matched (``re.search``) against the weight's
        name relative to its decoder layer (``self_attn.v_proj``, ``mlp.experts.down_proj``); the first match
        wins, else ``mix``, else ``quant.format`` (:mod:`jgptq.mixes`).
      mix: a llama.cpp mix preset (``"q4_k_m"``, ``"q5_k_m"``, ``"q4_k_s"``, ``"q5_k_s"``, ``"q3_k_m"``,
        ``"q6_k"``, ``"q2_k_s"``, ``"iq2_m"``, ``"mxfp4_moe"``; :mod:`jgptq.mixes` says what each raises). With ``quant.format="int"`` the preset's base
        format becomes ``quant.format``.
      block_fallback: a weight whose rows are not a whole number of its format's blocks: ``"error"`` (refused
        before any work), ``"llama.cpp"`` (llama.cpp's fallback table, e.g. q4_k -> q5_0) or a format name; a
        fallback is recorded in the report's warnings.
      target_bpw: bits per weight of the decoder layers' target tensors (None: off): each group (a layer's
        experts of one projection, or one linear module) gets the candidate format that minimises the measured,
        gain-weighted output error under the budget (:mod:`jgptq.allocate`, :mod:`jgptq_torch.pipeline.sensitivity`);
        ``formats`` and ``exclude`` still fix what they match (fixed costs). Not with ``mix``.
      target_formats: the candidates (GGML names, or ``"int2"`` .. ``"int8"``); empty: the run's default family.
      target_gain: ``"fisher"`` (output-gradient weight of each matrix) or ``"one"`` (unweighted GPTQ losses).
      assignment: ``((model parameter name, format), ...)``: a format per weight, as the target's first pass
        chose it (:func:`jgptq.plan.plan_matrix` applies it after the ``formats`` rules).
    """

    quant: QuantConfig = QuantConfig()
    moe: MoEConfig = MoEConfig()
    method: str = "gptq"
    hessian_dtype: str = "float32"
    batch_size: int = 8
    max_length: "int | None" = None
    exclude: tuple = ()
    keep_hessians: bool = False
    progress: bool = dataclasses.field(default=True, metadata=_WHERE)
    offload: str = dataclasses.field(default="none", metadata=_WHERE)
    offload_dir: "str | None" = dataclasses.field(default=None, metadata=_WHERE)
    device_budget: "int | None" = dataclasses.field(default=None, metadata=_WHERE)
    reload: bool = dataclasses.field(default=True, metadata=_WHERE)
    keep_offload_files: bool = dataclasses.field(default=False, metadata=_WHERE)
    importance: str = "imatrix"
    imatrix_source: str = "replay"
    formats: tuple = ()
    mix: "str | None" = None
    block_fallback: str = "error"
    target_bpw: "float | None" = None
    target_formats: tuple = ()
    target_gain: str = "fisher"
    assignment: tuple = ()

    def __post_init__(self):
        if not isinstance(self.quant, QuantConfig):
            _fail_in("PipelineConfig", "quant", self.quant, "must be a QuantConfig")
        if not isinstance(self.moe, MoEConfig):
            _fail_in("PipelineConfig", "moe", self.moe, "must be a MoEConfig")
        self._check_ggml()
        from jgptq.allocate import check_target

        check_target(self)
        object.__setattr__(self, "assignment", tuple((str(p), str(f).lower()) for p, f in self.assignment))
        from jgptq.methods import registry

        if self.method not in registry.names():
            _fail_in("PipelineConfig", "method", self.method, f"must be one of {registry.names()} (the methods "
                     f"registered with jgptq.methods.register)")
        if self.hessian_dtype not in HESSIAN_DTYPES:
            _fail_in("PipelineConfig", "hessian_dtype", self.hessian_dtype, f"must be one of {HESSIAN_DTYPES}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            _fail_in("PipelineConfig", "batch_size", self.batch_size, "must be a positive integer")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            _fail_in("PipelineConfig", "max_length", self.max_length, "must be None or a positive integer")
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        object.__setattr__(self, "exclude", tuple(self.exclude))
        for pattern in self.exclude:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as exc:
                _fail_in("PipelineConfig", "exclude", pattern, f"not a regular expression ({exc})")
        check_run_fields(self)

    def _check_ggml(self):
        from jgptq import mixes
        from jgptq.ggml.registry import get_format

        if self.importance not in IMPORTANCES:
            _fail_in("PipelineConfig", "importance", self.importance, f"must be one of {IMPORTANCES}")
        if self.imatrix_source not in IMATRIX_SOURCES:
            _fail_in("PipelineConfig", "imatrix_source", self.imatrix_source, f"must be one of {IMATRIX_SOURCES}")
        if self.mix is not None:
            if self.mix not in mixes.PRESETS:
                _fail_in("PipelineConfig", "mix", self.mix, f"must be None or one of {sorted(mixes.PRESETS)}")
            base, fmt = mixes.PRESETS[self.mix], mixes.run_format(self.mix, self.quant.format)
            if fmt != self.quant.format:
                object.__setattr__(self, "quant", self.quant.replace(format=fmt))
            elif fmt != base:
                _fail_in("PipelineConfig", "mix", self.mix, f"its base format is {base}, but quant.format is "
                         f"{self.quant.format!r} (leave format at 'int' or set it to {base!r})")
        rules = []
        for rule in tuple(self.formats):
            if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
                _fail_in("PipelineConfig", "formats", rule, "each rule must be a (regex, format) pair")
            pattern, fmt = rule
            try:
                re.compile(pattern)
            except (re.error, TypeError) as exc:
                _fail_in("PipelineConfig", "formats", pattern, f"not a regular expression ({exc})")
            rules.append((pattern, str(fmt).lower()))
        object.__setattr__(self, "formats", tuple(rules))
        if rules and not self.quant.is_ggml:
            _fail_in("PipelineConfig", "formats", self.formats, "per-weight GGML formats need a GGML quant.format "
                     "(or a mix) for the other weights; integer grids and GGML blocks do not mix in one run")
        if self.block_fallback not in ("error", "llama.cpp"):
            object.__setattr__(self, "block_fallback", str(self.block_fallback).lower())
        if not self.quant.is_ggml:
            if self.block_fallback != "error":
                _fail_in("PipelineConfig", "block_fallback", self.block_fallback, "only used with GGML formats")
            return
        for name in sorted(mixes.possible_formats(self)):
            try:
                fmt = get_format(name)
            except ValueError as exc:
                _fail_in("PipelineConfig", "formats", name, str(exc))
            if fmt.encode is None:
                _fail_in("PipelineConfig", "formats", name, "jgptq has no encoder for this GGML format")
            if self.importance == "none" and (fmt.requires_importance or fmt.name in mixes.NEEDS_IMPORTANCE):
                _fail_in("PipelineConfig", "importance", self.importance, f"format {fmt.name} needs importance "
                         f"weights (llama.cpp refuses it without an imatrix); use 'imatrix' or 'hessian'")

    @classmethod
    def build(cls, config=None, **kwargs) -> "PipelineConfig":
        """A config from a :class:`PipelineConfig`, a :class:`QuantConfig` or None, with field overrides.

        Keyword arguments may name fields of this class, of :class:`QuantConfig` (``bits=3``) or of
        :class:`MoEConfig` (``calibration="all_experts"``, ``min_tokens=16``); anything else raises TypeError.
        """
        if config is None:
            config = cls()
        elif isinstance(config, QuantConfig):
            config = cls(quant=config)
        elif not isinstance(config, cls):
            raise TypeError(f"config must be a PipelineConfig, a QuantConfig or None, got {type(config).__name__}")
        own = {f.name for f in dataclasses.fields(cls)}
        qf = {f.name for f in dataclasses.fields(QuantConfig)}
        mf = {f.name for f in dataclasses.fields(MoEConfig)}
        mine, quant, moe = {}, {}, {}
        for key, value in kwargs.items():
            if key in own:
                mine[key] = value
            elif key in qf:
                quant[key] = value
            elif key in mf:
                moe[key] = value
            else:
                raise TypeError(f"unknown option {key!r}: not a field of PipelineConfig, QuantConfig or MoEConfig")
        if quant:
            mine["quant"] = mine.get("quant", config.quant).replace(**quant)
        if moe:
            mine["moe"] = dataclasses.replace(mine.get("moe", config.moe), **moe)
        return dataclasses.replace(config, **mine) if mine else config

    def to_dict(self) -> dict:
        """Plain-Python form (JSON-serializable)."""
        return dataclasses.asdict(self)

    def what(self) -> dict:
        """What the run computes, in plain-Python form: every field but :data:`RUN_FIELDS` (where the layers live,
        the budget, progress bars), which a resumed run may change. The resume fingerprint hashes this."""
        out = self.to_dict()
        for name in RUN_FIELDS:
            out.pop(name)
        return out


# The fields that say where and how visibly a run works (marked ``where`` on the field), never what it computes:
# a resumed run may change them (:mod:`jgptq.run_fields` checks them).
RUN_FIELDS = tuple(f.name for f in dataclasses.fields(PipelineConfig) if f.metadata.get("where"))
