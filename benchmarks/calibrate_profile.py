"""Where a MoE layer's calibration time goes: the pipeline's calibrate stage split into timed sections.

The model is moe_model's Qwen3-30B-A3B shape at a reduced depth (``--layers``, default 3) with the same
calibration (128 x 2048 random tokens, batches of 16, bf16 Hessian operands), or with ``--shape qwen3_235b`` a
Qwen3-235B-A22B layer with stream_model's calibration (64 x 2048 tokens, batches of 8). ``jgptq.quantize_moe`` runs
twice on it:

1. sections: the functions of the calibrate stage are wrapped with timers that synchronize torch and JAX at both
   ends, so that each section owns the device work it launched. Sections nest; the JSON gives each one's
   exclusive seconds (its own minus its children's) per layer, and the warm-layer mean (layers after the first,
   whose figures hold compiles). Sections: ``layer forward`` (a decoder layer's calibration forward, outside the
   parts below: attention, norms, router), ``experts loop`` (the capture implementation's per-expert forward),
   ``routed packing`` (sorting each expert's rows into padded groups), ``group accumulate`` (the jitted sums of
   a group: Hessian and importance in one program), ``linear hooks`` (the attention projections' statistics),
   ``dlpack`` (torch -> JAX hand-offs). Synchronizing removes the overlap of host and device work, so the
   sections add up to more than the unsynchronized stage.
2. host profile: the same run without timers under ``cProfile``, once per offload mode (``--offload none,cpu``);
   the JSON lists the functions with the most host seconds (own time), which is where the host waits on the
   device or runs Python.

The per-stage times of both runs (``report.timings``) are in the JSON too.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import os
import pstats
import time

import numpy as np

from benchmarks import common
from benchmarks.moe_model import FULL, SMALL, build_model

DOC = __doc__.splitlines()[0]
SHAPES = {"qwen3_30b": FULL,
          "qwen3_235b": dict(FULL, hidden=4096, heads=64, kv_heads=4, width=1536, sequences=64, batch=8)}


class Sections:
    """Nested synchronized timers: ``exclusive[layer][name]`` seconds."""

    def __init__(self, sync):
        self.sync, self.stack, self.layer = sync, [], -1
        self.exclusive: dict = {}

    @contextlib.contextmanager
    def section(self, name, *results):
        self.sync()
        t0 = time.perf_counter()
        self.stack.append(0.0)
        try:
            yield
        finally:
            self.sync()
            inner = self.stack.pop()
            total = time.perf_counter() - t0
            row = self.exclusive.setdefault(self.layer, {})
            row[name] = row.get(name, 0.0) + total - inner
            if self.stack:
                self.stack[-1] += total

    def wrap(self, owner, attr, name):
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.section(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, timed)
        return fn


def _run(model, calib, quant, s, device, offload="none", profile_host=False):
    import jgptq

    kwargs = dict(device=device, batch_size=s["batch"], hessian_dtype="bfloat16", progress=False, offload=offload)
    prof = cProfile.Profile() if profile_host else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    result = jgptq.quantize_moe(model, calib, quant, **kwargs)
    if prof:
        prof.disable()
    total = time.perf_counter() - t0
    return result, total, prof


def _top(prof, n=30):
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}:{func}", "calls": nc, "own_s": tt,
                     "cumulative_s": ct})
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:n]


def _sections(model, calib, quant, s, device, mode, sync, layers):
    """Runs the pipeline once with synchronized timers around the calibrate stage's functions."""
    import jax

    from jgptq_torch.pipeline import calibrate as calibrate_mod
    from jgptq_torch.pipeline import capture
    from jgptq_torch.pipeline import experts_capture
    from jgptq_torch.pipeline import layerwise
    from jgptq import statistics

    sec = Sections(sync)
    originals = []
    process = layerwise._layer_step

    def process_layer(run, i, *a, **k):
        sec.layer = i
        return process(run, i, *a, **k)

    def run_layer(layer, hs, rest, kwargs):
        if capture._ACTIVE.get() is None:  # replay: timed by the report
            return run_layer.fn(layer, hs, rest, kwargs)
        with sec.section("layer forward"):
            return run_layer.fn(layer, hs, rest, kwargs)

    run_layer.fn = calibrate_mod.run_layer   # the calibration forwards run in jgptq_torch.pipeline.calibrate
    update_group = statistics.update_group  # the statistics chain's sums of a group of experts, one program

    def timed_group(*a, **k):
        with sec.section("group accumulate"):
            res = update_group(*a, **k)
            jax.block_until_ready(res)
        return res

    patches = [(layerwise, "_layer_step", process_layer), (calibrate_mod, "run_layer", run_layer),
               (statistics, "update_group", timed_group)]
    for owner, attr, new in patches:
        originals.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)
    for owner, attr, name in ((experts_capture, "experts_forward", "experts loop"),
                              (capture.Collector, "_add_grouped", "routed packing"),
                              (capture.Collector, "_add", "linear hooks"),
                              (capture, "to_jax", "dlpack")):
        originals.append((owner, attr, sec.wrap(owner, attr, name)))
    try:
        result, total, _ = _run(model, calib, quant, s, device, mode)
    finally:
        for owner, attr, fn in reversed(originals):
            setattr(owner, attr, fn)
    warm = [sec.exclusive[i] for i in range(1, layers) if i in sec.exclusive]
    names = sorted({n for row in sec.exclusive.values() for n in row})
    return {
        "total_s": total,
        "stage_s": result.report.stage_totals(),
        "per_layer_stage_s": {str(i): result.report.timings.get(i, {}) for i in range(layers)},
        "exclusive_s": {str(i): row for i, row in sorted(sec.exclusive.items())},
        "warm_mean_s": {n: float(np.mean([row.get(n, 0.0) for row in warm])) for n in names} if warm else {},
    }


def main(argv=None):
    p = common.parser("calibrate_profile", DOC)
    p.add_argument("--layers", type=int, default=3, help="decoder layers (default 3)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_30b",
                   help="qwen3_30b: moe_model's shape (128 x 2048 tokens in batches of 16); qwen3_235b: the "
                        "Qwen3-235B-A22B layer of stream_model (hidden 4096, 64/4 heads, 128 experts of width 1536, "
                        "64 x 2048 tokens in batches of 8) (default: qwen3_30b)")
    p.add_argument("--offload", default="none",
                   help="offload modes, comma-separated (e.g. none,cpu): the sections are timed with the first, a "
                        "host profile is taken with each (default: none)")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import torch

    from jgptq import QuantConfig

    s = dict(SMALL if args.small else SHAPES[args.shape])
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = build_model(s, args.layers, device)
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, s["vocab"], (s["sequences"], s["length"]), generator=g)
    quant = QuantConfig(bits=4, group_size=s["group"], block_size=s["group"], sym=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()
        (jax.numpy.zeros(()) + 0).block_until_ready()

    out = {"benchmark": "calibrate_profile", "description": __doc__, "small": bool(args.small), "shape_name": args.shape, "shape": s,
           "layers": args.layers, "device": device, "machine": common.machine()}

    # 1. synchronized sections, with the first offload mode
    modes = [m.strip() for m in args.offload.split(",") if m.strip()]
    out["sections"] = _sections(model, calib, quant, s, device, modes[0], sync, args.layers)
    out["sections"]["offload"] = modes[0]
    print({"sections_warm_mean_s": out["sections"]["warm_mean_s"]}, flush=True)
    common.write(args.out, out)

    # 2. host profile of untimed runs, one per offload mode
    out["host_profile"] = {}
    for mode in modes:
        result, total, prof = _run(model, calib, quant, s, device, mode, profile_host=True)
        out["host_profile"][mode] = {
            "total_s": total,
            "stage_s": result.report.stage_totals(),
            "per_layer_stage_s": {str(i): result.report.timings.get(i, {}) for i in range(args.layers)},
            "memory": result.report.memory,
            "top_own_s": _top(prof),
        }
        print({mode: out["host_profile"][mode]["stage_s"]}, flush=True)
        common.write(args.out, out)
    return 0
