"""Frozen, validated configuration objects.

:class:`QuantConfig` (:mod:`jgptq.quant_config`) says how one weight matrix is quantized, :class:`MoEConfig` how
experts are calibrated, :class:`PipelineConfig` the whole run. Every field is checked at construction with an
error that names the field and the rule. A field the ``jgptq`` command exposes declares its option in its metadata
(:func:`jgptq.options.flag`): the command's parser and its mapping to the configuration are made from it.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jgptq.options import comma_list, flag, format_rules, listed, negated
from jgptq.quant_config import ACT_ORDERS, AUTO_ORDER, SCALE_DTYPES, QuantConfig  # noqa: F401
from jgptq.run_fields import OFFLOADS, check_run_fields, parse_size  # noqa: F401
from jgptq.run_fields import fail_in as _fail_in

# The values a field may take (the command line offers the same choices).
MOE_CALIBRATIONS = ("routed", "all_experts")
ROUTER_WEIGHTINGS = {"none": 0.0, "linear": 1.0, "squared": 2.0}   # name -> power of the routing weight
HESSIAN_DTYPES = ("float32", "bfloat16")
IMPORTANCES = ("imatrix", "hessian", "none")
IMATRIX_SOURCES = ("replay", "float")


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

    calibration: str = dataclasses.field(default="routed", metadata=flag(
        "--calibration", "experts' Hessians from their routed tokens, or from every token (default: {default})",
        choices=MOE_CALIBRATIONS))
    min_tokens: int = dataclasses.field(default=1, metadata=flag(
        "--min-tokens", "experts with fewer calibration tokens are rounded to nearest, with a warning "
        "(default: {default})", type=int))
    min_token_fraction: float = 0.0
    router_weighting: str = dataclasses.field(default="none", metadata=flag(
        "--router-weighting", "weight each routed token in its expert's Hessians by the routing weight ('linear') "
        "or its square ('squared'); routed calibration only (default: {default})", choices=tuple(ROUTER_WEIGHTINGS)))

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


def _method_names() -> tuple:
    """The methods ``--method`` offers: those registered with :mod:`jgptq.methods` when the parser is built."""
    from jgptq.methods import registry

    return tuple(registry.names())


def _mix_names() -> tuple:
    """The llama.cpp mixes ``--mix`` offers (:data:`jgptq.mixes.PRESETS`)."""
    from jgptq.mixes import PRESETS

    return tuple(PRESETS)


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

    quant: QuantConfig = QuantConfig()   # noqa: RUF009 (frozen, so one shared default is safe)
    moe: MoEConfig = MoEConfig()
    method: str = dataclasses.field(default="gptq", metadata=flag(
        "--method", "gptq, or rtn: round-to-nearest on the same grids, a baseline; with a GGML format a plain encode "
        "with importance, as llama-quantize with an imatrix; any method built into jgptq.methods "
        "(default: {default})", choices=_method_names))
    hessian_dtype: str = dataclasses.field(default="float32", metadata=flag(
        "--hessian-dtype", "operands of the Hessian sums, accumulated in float32 (default: {default})",
        choices=HESSIAN_DTYPES))
    batch_size: int = dataclasses.field(default=8, metadata=flag(
        "--batch-size", "sequences per forward (default: {default})", type=int))
    max_length: int | None = dataclasses.field(default=None, metadata=flag(
        "--seq-len", "tokens per calibration sequence (default: {default})", type=int, default=512))
    exclude: tuple = dataclasses.field(default=(), metadata=flag(
        "--exclude", "leave modules matching this pattern (relative to a layer, e.g. 'self_attn') in floating "
        "point; repeatable", action="append", metavar="REGEX", default=None, to_config=listed))
    keep_hessians: bool = False
    progress: bool = dataclasses.field(default=True, metadata=_WHERE | flag(
        "--quiet", "no progress bars or messages", action="store_true", default=False, to_config=negated))
    offload: str = dataclasses.field(default="none", metadata=_WHERE | flag(
        "--offload", "where decoder layers wait while another is processed: none (where they are loaded), cpu "
        "(host memory), disk (one file per layer: host memory holds one layer) (default: {default})",
        choices=OFFLOADS))
    offload_dir: str | None = dataclasses.field(default=None, metadata=_WHERE | flag(
        "--offload-dir", "folder of the layer files of --offload disk (default: OUT.jgptq-work/offload)",
        metavar="DIR"))
    device_budget: int | None = dataclasses.field(default=None, metadata=_WHERE | flag(
        "--device-budget", "bytes the run may place on the device, e.g. 40GB: checked against each layer's "
        "estimated need before any work; a MoE layer over it has its routed experts calibrated and solved a chunk "
        "at a time (default: no check; on a GPU, chunks as its free memory needs)", metavar="SIZE"))
    reload: bool = dataclasses.field(default=True, metadata=_WHERE)
    keep_offload_files: bool = dataclasses.field(default=False, metadata=_WHERE)
    importance: str = dataclasses.field(default="imatrix", metadata=flag(
        "--importance", "importance of the GGML encoders: llama.cpp's imatrix statistic of the calibration tokens, "
        "the Hessian diagonal, or none (default: {default})", choices=IMPORTANCES))
    imatrix_source: str = dataclasses.field(default="replay", metadata=flag(
        "--imatrix-source", "inputs the imatrix statistic is collected on: replay (each layer's inputs in this run, "
        "earlier layers quantized) or float (earlier layers float, as llama-imatrix; one more forward per layer) "
        "(default: {default})", choices=IMATRIX_SOURCES))
    formats: tuple = dataclasses.field(default=(), metadata=flag(
        "--tensor-format", "GGML format of the weights whose name relative to a layer (self_attn.v_proj, "
        "mlp.experts.down_proj) matches REGEX; first match wins; repeatable", action="append",
        metavar="REGEX=FORMAT", default=None, to_config=format_rules))
    mix: str | None = dataclasses.field(default=None, metadata=flag(
        "--mix", "a llama.cpp mix for GGML formats (q4_k_m: q4_k with attn_v and ffn_down raised to q6_k on "
        "llama.cpp's layers, ...); sets --format to its base", choices=_mix_names))
    block_fallback: str = dataclasses.field(default="error", metadata=flag(
        "--block-fallback", "GGML weights whose rows are not whole blocks of their format: 'error', 'llama.cpp' "
        "(llama.cpp's fallback types) or a format name (default: {default})", metavar="FORMAT"))
    target_bpw: float | None = dataclasses.field(default=None, metadata=flag(
        "--target-bpw", "bits per weight of the decoder layers' tensors: each tensor group (a layer's experts of one "
        "projection, or one linear module) gets the candidate format whose measured output error is lowest under "
        "that budget; --tensor-format and --exclude still fix what they match", type=float, metavar="BITS"))
    target_formats: tuple = dataclasses.field(default=(), metadata=flag(
        "--target-formats", "comma-separated candidates of --target-bpw/--target-size (GGML formats, or int2..int8 "
        "for integer grids) (default: a family of the run's kind)", metavar="LIST", default=None,
        to_config=comma_list))
    target_gain: str = dataclasses.field(default="fisher", metadata=flag(
        "--target-gain", "weight of each tensor's error: its output gradient's Fisher information, or one "
        "(default: {default})", choices=("fisher", "one")))
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
    def build(cls, config=None, **kwargs) -> PipelineConfig:
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
