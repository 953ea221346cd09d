"""What a quantization run produced: the quantized tensors (for exporters) and a report (for people).

- ``QuantizeResult.weights``: :class:`jgptq.export.QuantizedWeight` records (codes, scales, zeros, g_idx; or
  :class:`jgptq.export.GGMLWeight` payloads for GGML formats) by
  checkpoint key, named as ``save_pretrained`` writes them (fused experts split per expert, e.g.
  ``model.layers.3.mlp.experts.17.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.17.w1.weight``). The
  dequantized weight is ``scales[:, g_idx] * (codes - zeros[:, g_idx])`` in nn.Linear (out, in) orientation,
  the very records the exporters of :mod:`jgptq.export` take.
- :class:`Report`: one :class:`ModuleRecord` per solved matrix (loss, damping, fallback, tokens, dead columns),
  expert coverage per MoE layer, seconds per stage per layer, warnings. ``report.to_json(path)`` writes it,
  ``print(report)`` / ``report.summary()`` shows a table.
- :class:`QuantizeResult`: the model (quantized in place), ``weights`` (name -> QuantizedWeight), ``report``,
  ``config`` (the :class:`jgptq.config.PipelineConfig` of the run).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Optional

import numpy as np


def format_bytes(n: float) -> str:
    """``n`` bytes as text in decimal units (``"1.50 GB"``)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000


@dataclasses.dataclass
class ModuleRecord:
    """One solved matrix: a linear module, one expert's fused gate/up or down projection, or one expert of a
    stack that is a module of its own."""

    name: str
    layer: int
    kind: str                    # "linear" | "expert_gate_up" | "expert_down" | "expert_stack"
    shape: tuple
    tokens: int
    method: str                  # "gptq" | "rtn"
    reason: str = ""             # why rtn, when it is
    loss: float = float("nan")
    damp_used: float = float("nan")
    damp_stage: int = -1
    fallback: bool = False       # no damping made the Hessian positive definite (round-to-nearest)
    dead_columns: int = 0
    hessian: str = ""            # the Hessian it shares (tie leader)
    format: str = "int"          # "int" (integer grids) or the GGML format of its blocks


@dataclasses.dataclass
class Report:
    """Per-module results, expert coverage, timings and warnings of one run."""

    config: dict
    model: str = ""
    calibration_tokens: int = 0
    records: list = dataclasses.field(default_factory=list)
    coverage: dict = dataclasses.field(default_factory=dict)     # experts module -> tokens per expert
    thresholds: dict = dataclasses.field(default_factory=dict)   # experts module -> min tokens for GPTQ
    timings: dict = dataclasses.field(default_factory=dict)      # layer index -> {stage: seconds}
    skipped: list = dataclasses.field(default_factory=list)      # (name, reason) left in floating point
    warnings: list = dataclasses.field(default_factory=list)
    memory: dict = dataclasses.field(default_factory=dict)      # bytes by place (see jgptq_torch.pipeline.offload)
    allocation: dict = dataclasses.field(default_factory=dict)  # a target_bpw run's choice (jgptq_torch.pipeline.sensitivity)
    prescale: dict = dataclasses.field(default_factory=dict)    # layer -> producer -> awq's scales (pipeline.prescale)

    def add_time(self, layer: int, stage: str, seconds: float):
        stages = self.timings.setdefault(int(layer), {})
        stages[stage] = stages.get(stage, 0.0) + float(seconds)

    def stage_totals(self) -> dict:
        total: dict = {}
        for stages in self.timings.values():
            for k, v in stages.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def fallbacks(self) -> list:
        """Records quantized by round-to-nearest in a GPTQ run, or whose damping ladder failed."""
        return [r for r in self.records if r.fallback or (r.method == "rtn" and r.reason)]

    def to_dict(self) -> dict:
        def clean(v):
            if isinstance(v, float) and not np.isfinite(v):
                return None
            return v

        records = [{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in self.records]
        return {
            "model": self.model, "config": self.config, "calibration_tokens": self.calibration_tokens,
            "records": records, "coverage": self.coverage, "thresholds": self.thresholds,
            "timings": {str(k): v for k, v in self.timings.items()}, "stage_totals": self.stage_totals(),
            "skipped": [list(s) for s in self.skipped], "warnings": list(self.warnings), "memory": self.memory,
            "allocation": self.allocation, "prescale": self.prescale,
        }

    def to_json(self, path: Optional[str] = None, **kwargs) -> str:
        """The report as JSON text (also written to ``path`` when given)."""
        text = json.dumps(self.to_dict(), indent=kwargs.pop("indent", 1), **kwargs)
        if path is not None:
            with open(path, "w") as fh:
                fh.write(text)
        return text

    def coverage_table(self, full: bool = False) -> str:
        """Tokens routed to each expert: one summary line per experts module, or (``full``) every expert's count,
        ``*`` marking those below the GPTQ threshold (round-to-nearest)."""
        lines = []
        for name, counts in self.coverage.items():
            if full:
                thr = self.thresholds.get(name, 1)
                cells = [f"{e:>4}:{c:>7}{'*' if c < thr else ' '}" for e, c in enumerate(counts)]
                lines.append(f"{name} (threshold {thr})")
                lines += ["  " + " ".join(cells[i:i + 8]) for i in range(0, len(cells), 8)]
                continue
            thr = self.thresholds.get(name, 1)
            low = [e for e, c in enumerate(counts) if c < thr]
            lines.append(f"{name}: {len(counts)} experts, tokens min {min(counts)} / median "
                         f"{statistics.median(counts):g} / max {max(counts)}; below {thr}: "
                         f"{low if low else 'none'}")
        return "\n".join(lines)

    def summary(self) -> str:
        """A plain-text table: one line per layer, then coverage, stage times and warnings."""
        rows = [f"{'layer':>5} {'matrices':>8} {'gptq':>5} {'rtn':>4} {'fallback':>8} {'dead':>5} "
                f"{'mean loss':>11} {'max loss':>11} {'seconds':>8}"]
        by_layer: dict = {}
        for r in self.records:
            by_layer.setdefault(r.layer, []).append(r)
        for layer in sorted(by_layer, key=lambda k: (k < 0, k)):   # embeddings and head (-1) last
            recs = by_layer[layer]
            losses = [r.loss for r in recs if np.isfinite(r.loss)]
            secs = sum(self.timings.get(layer, {}).values()) if layer >= 0 else 0.0
            mean, top = (f"{np.mean(losses):>11.4g}", f"{max(losses):>11.4g}") if losses else (f"{'-':>11}",) * 2
            rows.append(f"{layer if layer >= 0 else 'edges':>5} {len(recs):>8} "
                        f"{sum(r.method == 'gptq' for r in recs):>5} "
                        f"{sum(r.method == 'rtn' for r in recs):>4} {sum(r.fallback for r in recs):>8} "
                        f"{sum(r.dead_columns for r in recs):>5} {mean} {top} {secs:>8.2f}")
        if -1 in by_layer:
            rows.append("edges: the token embeddings and output head, encoded without calibration (no GPTQ loss)")
        out = ["jgptq report" + (f" for {self.model}" if self.model else "")
               + f" ({self.calibration_tokens} calibration tokens)", *rows]
        formats: dict = {}
        for r in self.records:
            formats[r.format] = formats.get(r.format, 0) + 1
        if set(formats) - {"int"}:
            out.append("formats (matrices): " + ", ".join(f"{f} {n}" for f, n in sorted(formats.items())))
        if self.allocation:
            a = self.allocation
            out.append(f"target {a['target_bpw']:g} bpw: {a['achieved_bpw']:.4f} bpw, {a['total_bytes']} of "
                       f"{a['budget_bytes']} bytes; predicted objective {a['predicted_objective']:.4g} "
                       f"(gain {a['gain']})")
            out.append(self.allocation_table())
        if self.coverage:
            out += ["expert coverage:", self.coverage_table()]
            low = {n: c for n, c in self.coverage.items() if min(c) < self.thresholds.get(n, 1)}
            if low:  # every expert's count where some fell back to round-to-nearest
                out.append(Report(config={}, coverage=low, thresholds=self.thresholds).coverage_table(full=True))
        totals = self.stage_totals()
        if totals:
            out.append("seconds per stage: " + ", ".join(f"{k} {v:.2f}" for k, v in totals.items()))
        if self.skipped:
            out.append(f"left in floating point: {len(self.skipped)} parameters")
        if "peak_parameters_on_device" in self.memory:
            out.append(self.memory_line())
        for w in self.warnings:
            out.append(f"warning: {w}")
        return "\n".join(out)

    def allocation_table(self) -> str:
        """A target_bpw run's choice, one line per tensor group: layer, name, format, bits per weight, bytes and the
        cost of the chosen candidate (empty for other runs)."""
        a = self.allocation
        if not a:
            return ""
        lines = [f"{'layer':>5} {'tensor group':<28} {'format':<8} {'bpw':>6} {'bytes':>12} {'cost':>11}"]
        for g in a["groups"]:
            lines.append(f"{g['layer']:>5} {g['name']:<28} {g['format']:<8} {g['bpw']:>6.3f} {g['bytes']:>12} "
                         f"{g['costs'][g['format']]:>11.4g}")
        for f in a["fixed"]:
            lines.append(f"{'':>5} {f['param']} fixed at {f['format']}, {f['bytes']} bytes")
        return "\n".join(lines)

    def bits_by_layer(self) -> dict:
        """Tensor group name -> bits per weight chosen in each layer (NaN where the layer has no such group), and
        the sorted layers: ``({name: [bpw, ...]}, layers)``; empty for runs without target_bpw."""
        groups = self.allocation.get("groups", []) if self.allocation else []
        layers = sorted({g["layer"] for g in groups})
        out: dict = {}
        for g in groups:
            out.setdefault(g["name"], [float("nan")] * len(layers))[layers.index(g["layer"])] = g["bpw"]
        return out, layers

    def memory_line(self) -> str:
        """One line on memory: offload mode, peak parameter bytes on the device (and the budget), the largest
        layer's estimated need, peak parameter bytes in host memory."""
        m = self.memory
        budget = f" of a {format_bytes(m['budget'])} budget" if m.get("budget") else ""
        need = m.get("need", {})
        return (f"memory (offload {m.get('offload')}, device {m.get('device')}): peak parameters on the device "
                f"{format_bytes(m['peak_parameters_on_device'])}{budget}; largest need "
                f"{format_bytes(need.get('total', 0))} (layer {need.get('layer')}); peak parameters in host memory "
                f"{format_bytes(m['peak_host_parameters'])}")

    def __str__(self) -> str:
        return self.summary()


@dataclasses.dataclass
class QuantizeResult:
    """What :func:`jgptq.quantize_moe` returns.

    Attributes:
      model: the torch model, its targeted weights replaced in place by their dequantized values.
      weights: checkpoint key -> :class:`jgptq.export.QuantizedWeight` (everything an exporter needs; no
        re-quantization).
      report: the :class:`Report`.
      hessians: (layer, Hessian key) -> (finalized Hessian jax.Array, token counts) when ``keep_hessians``.
      config: the :class:`jgptq.config.PipelineConfig` of the run.
      param_keys: model parameter name (``state_dict`` naming) -> the checkpoint keys of ``weights`` its rows
        went to (exporters drop these parameters from the unquantized tensors).
      imatrix: model parameter name -> :class:`jgptq.imatrix.ImatrixEntry`: llama.cpp's importance statistic of
        every quantized weight (per column sums of squared inputs in float32 and token counts; per expert over
        its routed tokens only, whatever the calibration mode). ``jgptq.imatrix.write_imatrix`` writes it.
    """

    model: object
    weights: dict
    report: Report
    hessians: dict = dataclasses.field(default_factory=dict)
    config: object = None
    param_keys: dict = dataclasses.field(default_factory=dict)
    imatrix: dict = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return self.report.summary()
