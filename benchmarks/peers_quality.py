"""Integer-grid quality beside the peers: jgptq and llm-compressor (GPTQ, AWQ, AutoRound) on one trained MoE model,
each checkpoint reloaded through transformers and measured as KL to the float model on held-out text.

The model: the trained byte-level Qwen3-MoE ``deep`` of the quality benchmark (``benchmarks/quality/lm.py``: 4
decoder layers of hidden 512, 8 experts of width 512, top-2; cached in ``~/.cache/jgptq/gguf_quality``, trained first
when missing). Both sides get the same calibration windows (``--calib-seqs`` x ``--calib-len`` bytes of the corpus's
calibration split) and every checkpoint is measured on the same held-out windows.

Each quantization runs in a fresh process of its own (``benchmarks/quality/peers_worker.py``, which says exactly
what each side is given) that loads the float folder, quantizes, and writes a compressed-tensors
``pack-quantized`` folder; its seconds are those of the quantization call alone (``quantize_moe`` / ``oneshot``),
on the same CPU threads. Then this process loads every folder with ``AutoModelForCausalLM.from_pretrained`` (the
compressed-tensors integration decompressing it; fused experts reassembled from the per-expert tensors), checks
that every quantized projection holds at most ``2**bits`` distinct values in each group of 128 and differs from
the float weights, and evaluates it against the float model (:func:`jgptq_torch.cli.evaluate.evaluate`,
llama-perplexity's definition: windows from an empty context, second half scored): mean KL per token with its
standard error, p99, top-1 agreement, perplexity, and the paired per-token KL difference of every row against the
best jgptq row of its width (negative: the row is closer to the float model than jgptq's best).

Rows, at each of ``--bits`` (default int4 and int3, symmetric, groups of 128, scales float32 on both sides):

- ``jgptq:rtn|gptq|gptq_search``: jgptq's own defaults (each expert calibrated on its routed tokens, static
  activation order on integer grids, damping 0.01, batch 16); ``+field=value`` overrides a config field:
  ``act_order=none`` (the natural order, jgptq's earlier default), ``act_order=group_aware``,
  ``static_groups=true`` (grids from the original weight in natural order), ``mse=2.4`` (clip search),
  ``router_weighting=linear|squared`` (each routed token weighted in its expert's Hessians by its routing weight or
  its square), ``calibration=all_experts`` (every expert sees every token;
  ``gptq+calibration=all_experts+act_order=static`` is GPTQ set up as llm-compressor runs it).
- ``llmcompressor:gptq|awq|autoround``: llm-compressor's ``oneshot`` with its defaults (batch 1, every expert
  calibrated on every token), scheme ``W4A16`` / ``W3A16`` (its int presets: symmetric, groups of 128, min-max
  weight observer), ``ignore=["lm_head", "re:.*mlp.gate$"]``; GPTQModifier (static activation order, damping
  0.01), AWQModifier (its Qwen3-MoE mappings, duo scaling) before a QuantizationModifier, AutoRoundModifier (200
  iterations a layer, batch 8). The experts are made ``nn.Linear`` modules by ``linearize_moe``. Without CUDA the
  AWQ row runs with the pinning of llm-compressor's activation cache disabled (torch cannot pin memory without an
  accelerator; the row's ``settings.patches`` says so).

A row whose quantization or loading fails keeps its error text in the JSON. The results go to
``benchmarks/results/peers_quality.json`` and a KL-against-seconds chart beside it (``peers_quality.svg``).

Every row runs in the same Python as this process (a fresh process each: ``sys.executable``), on ``--device``
(``auto``: CUDA when torch sees it). On CUDA the float model is trained there too (seconds; a CUDA-trained model is
its own cache entry) and cached under the run's ``--work`` folder, every checkpoint is evaluated there, and the
results go to ``peers_quality_gpu.json``. Each jgptq row compiles its programs itself
(``JGPTQ_COMPILATION_CACHE=off`` unless ``--compile-cache shared``), so its seconds are those of a first run on the
machine, as the peers' are. Per width the JSON holds the verdict (:mod:`benchmarks.quality.peers_verdict`): jgptq's
best row against every peer row, paired difference and its standard error, and the time ratio to AutoRound.
``--deadline S`` stops starting rows after S seconds (those left are marked ``skipped``), so that a run bounded from
outside still writes its verdict and chart.

Setting up. llm-compressor 0.14.0.1 pins transformers<=5.17, compressed-tensors 0.19.0, accelerate>=1.15 and
auto-round<=0.15.1. On the GPU machine (Python 3.12, torch 2.11, transformers 5.17, no network) the missing packages
travel as wheels made by ``benchmarks/anchors/fetch_wheels.sh``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks peers_quality --work /tmp/pq --deadline 480

Elsewhere, a virtualenv with those pins (the CPU torch installed first so that pip keeps it) and
``pip install --no-deps -e .`` for jgptq; ``--work DIR`` keeps the folders and the workers' JSON, and a rerun with
the same ``--work`` reuses every finished quantization (``--redo`` runs them again).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common
from benchmarks.quality.peers_verdict import best_row, paired, verdict

__all__ = ["best_row", "grid_check", "main", "paired", "short_label"]

DOC = __doc__.splitlines()[0]
JGPTQ_ROWS = "gptq,gptq_ef_half,gptq_ef"
ABLATION_ROWS = ("rtn,gptq,gptq+act_order=none,gptq+act_order=group_aware,gptq+static_groups=true+act_order=none,"
              "gptq+mse=2.4,gptq+router_weighting=linear,gptq+router_weighting=squared,"
              "gptq+router_weighting=squared+act_order=none,gptq+calibration=all_experts+act_order=none,"
              "gptq+calibration=all_experts+act_order=static,gptq_search,gptq_search+act_order=none")
PEER_ROWS = "gptq,awq,autoround"
CHART_SIDES = {"jgptq": "jgptq", "llmcompressor": "llm-compressor"}
OMITTED = {"gptqmodel:gptq,gptaq": (
    "left out: GPTQModel 7.7's end-to-end path (GPTQModel.load, quantize, save) writes its own GPTQ checkpoint "
    "format, which transformers reloads only through optimum (not on the GPU machine), so the row would need a "
    "converter of its packed codes to compressed-tensors of our own; and it could not be tried where this benchmark "
    "was prepared: on a CPU machine of 2 cores its loader stops in its own thread pool (ValueError: Virtual pool "
    "'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1), and no GPU run was made there. Its GPTQ "
    "solver alone is set beside jgptq's on the same (W, H) by peers_solver")}


def grid_check(model, reference, bits: int, group: int) -> dict:
    """Most distinct values in one group of ``group`` consecutive inputs over every quantized projection of
    ``model`` (a loaded, decompressed model), and the share of those weights that differ from ``reference``'s."""
    import torch

    ref = reference.state_dict()
    most, changed, total, names = 0, 0, 0, 0
    with torch.no_grad():
        for name, w in model.state_dict().items():
            if "_proj" not in name or w.ndim < 2 or name not in ref or not w.is_floating_point():
                continue
            g = w.float().reshape(-1, group).sort(dim=1).values
            most = max(most, int(((g[:, 1:] != g[:, :-1]).sum(dim=1) + 1).max()))
            changed += int((w != ref[name]).sum())
            total += w.numel()
            names += 1
    return {"tensors": names, "max_distinct_per_group": most, "grid_levels": 2 ** bits,
            "share_changed": changed / max(total, 1), "ok": names > 0 and most <= 2 ** bits}


_SHORT = (("act_order=", ""), ("router_weighting=", "rw:"), ("calibration=all_experts", "all"),
          ("static_groups=true", "sg"), ("group_aware", "gar"))


def short_label(spec: str) -> str:
    """A row's label in the chart: ``gptq+router_weighting=squared+act_order=none`` -> ``gptq+rw:squared+none``."""
    for long, short in _SHORT:
        spec = spec.replace(long, short)
    return spec


def _worker(side, spec, bits, args, folder, calib_path, work, timeout) -> dict:
    tag = f"{side}-{spec.replace('+', '_').replace('=', '-')}-int{bits}"
    out, res_path, log_path = (os.path.join(work, tag + x) for x in ("", ".json", ".log"))
    if not args.redo and os.path.exists(res_path) and os.path.isdir(out):
        with open(res_path) as f:
            res = json.load(f)
        if res.get("ok"):
            res["reused"] = True
            return res | {"folder": out}
    cmd = [sys.executable, "-m", "benchmarks.quality.peers_worker", "--side", side, "--method", spec, "--bits",
           str(bits), "--group-size", str(args.group_size), "--model", folder, "--calib", calib_path, "--out", out,
           "--result", res_path, "--device", args.device]
    env = dict(os.environ)
    if args.compile_cache == "off":
        env["JGPTQ_COMPILATION_CACHE"] = "off"
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env,
                                  cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = time.perf_counter() - t0
    if os.path.exists(res_path):
        with open(res_path) as f:
            res = json.load(f)
    else:
        with open(log_path) as f:
            tail = f.read()[-2000:]
        why = f"timed out after {timeout:.0f} s" if code is None else f"exited {code}"
        res = {"ok": False, "error": f"worker {why} without a result; log tail: {tail}"}
    res.update({"worker_wall_s": wall, "load_average_at_start": load, "folder": out})
    return res


def _options(argv):
    p = common.parser("peers_quality", DOC)
    common.integer_grid_options(p, windows=128, model="deep")
    p.add_argument("--jgptq", default=JGPTQ_ROWS, help="jgptq rows: method[+field=value...], comma-separated "
                                                       "('ablation': the settings compared earlier)")
    p.add_argument("--peers", default=PEER_ROWS, help="llm-compressor rows: gptq, awq, autoround")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (CUDA when torch sees it)")
    p.add_argument("--work", default=None, help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("--model-cache", default=None, help="where the trained float model is cached (default: "
                                                       "WORK/models on CUDA, the quality benchmark's cache on the CPU)")
    p.add_argument("--compile-cache", choices=("off", "shared"), default="off",
                   help="off: each jgptq row compiles its programs itself; shared: jgptq's persistent cache")
    p.add_argument("--redo", action="store_true", help="quantize again even where --work holds a result")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds allowed to one quantization")
    p.add_argument("--deadline", type=float, default=None, help="start no row after this many seconds")
    args = p.parse_args(argv)
    if args.jgptq == "ablation":
        args.jgptq = ABLATION_ROWS
    if args.small:
        args.train_steps = args.train_steps or 4
        args.calib_seqs, args.calib_len, args.windows = min(args.calib_seqs, 8), min(args.calib_len, 128), \
            min(args.windows, 4)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device")
    if torch.device(args.device).type == "cuda" and args.out == p.get_default("out"):
        args.out = os.path.join(os.path.dirname(args.out), "peers_quality_gpu.json")
    return args


def _evaluate_row(row, res, bits, args, float_model, held, per_token, name):
    import torch
    from transformers import AutoModelForCausalLM

    from jgptq_torch.cli.evaluate import evaluate

    model = AutoModelForCausalLM.from_pretrained(res["folder"], dtype=torch.float32).eval().to(args.device)
    ev = evaluate(model, float_model, tokens=held)
    row["grid_check"] = grid_check(model, float_model, bits, args.group_size)
    s = ev.summary
    per_token[name] = np.asarray(ev.per_token["kl"], np.float64)
    row.update({"kl_mean": s["kl_mean"], "kl_stderr": s["kl_mean_stderr"], "kl_p99": s["kl_p99"],
                "top1_agreement": s["same_top_rate"], "ppl": s["ppl"], "ppl_float": s["ppl_ref"],
                "tokens_scored": s["tokens"]})
    print(f"int{bits} {name}: KL {s['kl_mean']:.3g} +- {s['kl_mean_stderr']:.2g}, p99 {s['kl_p99']:.3g}, top1 "
          f"{s['same_top_rate']:.4f}, ppl {s['ppl']:.4f}, {row['quantize_s']:.1f} s, grid {row['grid_check']}",
          flush=True)


def main(argv=None):
    t_start = time.perf_counter()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # the workers' JAX shares the GPU
    args = _options(argv)
    import torch

    from benchmarks.gguf_quality import DEFAULT_CACHE
    from benchmarks.quality import corpus, lm
    from benchmarks.quality.peers_chart import kl_seconds_chart

    torch.manual_seed(0)
    work = args.work or tempfile.mkdtemp(prefix="peers_quality_")
    os.makedirs(work, exist_ok=True)
    cuda = torch.device(args.device).type == "cuda"
    cache = args.model_cache or (os.path.join(work, "models") if cuda else DEFAULT_CACHE)
    t0 = time.perf_counter()
    splits, float_model, info = lm.named_model(args.model, cache, steps=args.train_steps, device=args.device)
    model_s = time.perf_counter() - t0
    float_model = float_model.to(args.device)
    calib = corpus.windows(splits.tokens["calib"], args.calib_len, args.calib_seqs)
    calib_path = os.path.join(work, f"calib-{calib.shape[0]}x{calib.shape[1]}.npy")
    np.save(calib_path, calib)
    held = corpus.windows(splits.tokens["heldout"], args.n_ctx, args.windows)
    rows_of = [("jgptq", s.strip()) for s in args.jgptq.split(",") if s.strip()] + \
              [("llmcompressor", s.strip()) for s in args.peers.split(",") if s.strip()]
    out = {"benchmark": "peers_quality", "description": __doc__, "small": bool(args.small),
           "model": {k: v for k, v in info.items() if k != "loss_history"} | {"ready_s": model_s},
           "settings": {"model": args.model, "group_size": args.group_size, "sym": True,
                        "calibration": list(calib.shape), "windows": len(held), "n_ctx": args.n_ctx,
                        "rows": [f"{a}:{b}" for a, b in rows_of], "work": work, "device": args.device,
                        "compile_cache": args.compile_cache, "deadline_s": args.deadline,
                        "cpu_threads": torch.get_num_threads(), "python": sys.version.split()[0]},
           "packages": _versions(), "omitted_rows": OMITTED, "runs": {}, "verdict": {}}
    if cuda:
        out["settings"]["gpu"] = torch.cuda.get_device_name()
    for bits in [int(b) for b in args.bits.split(",") if b.strip()]:
        rows, per_token = {}, {}
        out["runs"][f"int{bits}"] = rows
        for side, spec in rows_of:
            name = f"{side}:{spec}"
            left = None if args.deadline is None else args.deadline - (time.perf_counter() - t_start)
            if left is not None and left <= 0:
                rows[name] = {"side": side, "method": spec, "skipped": f"the --deadline of {args.deadline:.0f} s "
                                                                       "had passed before this row's turn"}
                print(f"int{bits} {name}: skipped (deadline)", flush=True)
                continue
            timeout = args.timeout if left is None else max(1.0, min(args.timeout, left))
            res = _worker(side, spec, bits, args, info["folder"], calib_path, work, timeout)
            row = {"side": side, "method": spec, **{k: v for k, v in res.items() if k not in ("side", "method")}}
            rows[name] = row
            if res.get("ok"):
                try:
                    _evaluate_row(row, res, bits, args, float_model, held, per_token, name)
                except Exception as exc:  # noqa: BLE001 - loading or evaluating the written folder failed: said, not hidden
                    row["load_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            else:
                print(f"int{bits} {name}: FAILED {res.get('error', '')[:300]}", flush=True)
            common.write(args.out, out)
        best = best_row(rows)
        if best is not None:
            rows["paired_minus_jgptq_best"] = {"best": best, **{
                n: paired(per_token[n], per_token[best]) for n in per_token if n != best}}
            for n, d in rows["paired_minus_jgptq_best"].items():
                if n != "best":
                    print(f"int{bits} {n} - {best}: {d['mean']:.3g} +- {d['stderr']:.2g} per token", flush=True)
        out["verdict"][f"int{bits}"] = v = verdict(rows, per_token)
        print(f"int{bits} verdict: claim holds: {v['claim_holds']} (best {v['best']}, time ratio vs AutoRound "
              f"{v.get('time_ratio_vs_autoround')})", flush=True)
        common.write(args.out, out)
    _chart(out, args, kl_seconds_chart)
    out["total_s"] = time.perf_counter() - t_start
    out["machine"] = common.machine()
    common.write(args.out, out)
    return 0


def _chart(out, args, kl_seconds_chart) -> None:
    series = {}
    for width, rows in out["runs"].items():
        for name, r in rows.items():
            if "kl_mean" in r:
                label = CHART_SIDES.get(r["side"], r["side"])
                series.setdefault(f"{label} {width}", []).append(
                    (r["quantize_s"], r["kl_mean"], r["kl_stderr"], short_label(r["method"])))
    if series:
        chart = os.path.splitext(args.out)[0] + ".svg"
        with open(chart, "w") as f:
            f.write(kl_seconds_chart(series, title=f"KL to float against quantization time ({args.model} model, "
                                                   f"g{args.group_size}, {args.device})"))
        out["chart"] = os.path.basename(chart)
        print(f"wrote {chart}")


def _versions() -> dict:
    from importlib import metadata

    found = {}
    for name in ("jgptq", "llmcompressor", "compressed-tensors", "auto-round", "gptqmodel", "transformers",
                 "accelerate", "torch", "jax", "jaxlib"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
