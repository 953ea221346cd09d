"""One quantization of the peers_quality benchmark in a process of its own: a float model folder in, a
compressed-tensors folder and a JSON of what it took out.

``python -m benchmarks.quality.peers_worker --side jgptq|llmcompressor --method M --bits B --model FOLDER
--calib CALIB.npy --out OUT_FOLDER --result RESULT.json [--device cpu|cuda]``

Each run starts from the float checkpoint on disk in a fresh interpreter, so no run sees another's state (llm-compressor
keeps a global session and registers checkpoint conversions for the model type while it loads; jgptq keeps compiled
programs). The seconds reported are those of the quantization call alone, measured the same way for every side:
wall time from just before the call to just after it, with ``torch.cuda.synchronize()`` on both ends on CUDA (jgptq's
call returns its codes as host arrays, so it has waited for its JAX solves already); loading, imports and saving
are apart, each timed too. The model is loaded on the host, as ``from_pretrained`` leaves it; on CUDA jgptq runs
each layer there (``device="cuda"``), llm-compressor moves layers there itself (its pipelines onload each layer to the
first accelerator).

- ``jgptq``: ``jgptq.quantize_moe`` with the method of ``--method`` (``rtn``, ``gptq``, ``gptq_search``, ...,
  optionally followed by config overrides, ``gptq+calibration=all_experts+act_order=static``), symmetric grids of
  ``bits`` bits in groups of ``group_size``, scales stored in float32 (the model's dtype), otherwise jgptq's
  defaults (each expert calibrated on its routed tokens, static column order, damping 0.01); written by
  ``jgptq_torch.export.checkpoint.export_model(..., "compressed-tensors")``.
- ``llmcompressor``: the model loaded under ``load_quantizable_moe`` (llm-compressor's documented way in for fused
  MoE experts: each expert becomes ``nn.Linear`` modules), then ``oneshot`` with its defaults (batch 1, every
  expert calibrated on every token, ``moe_calibrate_all_experts=True``) and the recipe of ``method``: ``gptq``
  (GPTQModifier), ``awq`` (AWQModifier then QuantizationModifier, the non-deprecated form) or ``autoround``
  (AutoRoundModifier), each with the preset scheme ``W{bits}A16`` (int, symmetric, groups of 128, weight
  observer min-max) and ``ignore=["lm_head", "re:.*mlp.gate$"]`` (the routers); saved with
  ``save_pretrained(save_compressed=True)``. Without CUDA, AWQ runs with :data:`NO_PINNING`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback

IGNORE = ["lm_head", "re:.*mlp.gate$"]
LC_METHODS = ("gptq", "awq", "autoround")
NO_TORCHVISION = ("linearize_moe after a plain from_pretrained (what oneshot itself falls back to): "
                  "load_quantizable_moe cannot run without torchvision, which transformers 5.17's class patching "
                  "imports through every image processor (ModuleNotFoundError), and PyPI has no torchvision for a "
                  "CPU-only torch")


def _calib_loader(calib):
    import torch

    rows = [{"input_ids": calib[i], "attention_mask": torch.ones_like(calib[i])} for i in range(calib.shape[0])]
    return torch.utils.data.DataLoader(rows, batch_size=1, shuffle=False)


def lc_recipe(method: str, bits: int, group_size: int):
    """llm-compressor's modifiers for ``method`` at ``bits`` (its preset ``W{bits}A16`` scheme, groups of 128)."""
    if group_size != 128:
        raise ValueError(f"llm-compressor's W{bits}A16 preset has groups of 128, not {group_size}")
    scheme = f"W{bits}A16"
    if method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        return GPTQModifier(scheme=scheme, targets="Linear", ignore=IGNORE)
    if method == "awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [AWQModifier(), QuantizationModifier(scheme=scheme, targets="Linear", ignore=IGNORE)]
    if method == "autoround":
        from llmcompressor.modifiers.autoround import AutoRoundModifier

        return AutoRoundModifier(scheme=scheme, targets="Linear", ignore=IGNORE)
    raise ValueError(f"unknown llm-compressor method {method!r}; choose one of {LC_METHODS}")


NO_PINNING = ("IntermediatesCache.pin_memory made a no-op: AWQModifier pins its cached activations (on the CPU, "
              "the offload device it picks for MoE models) for faster host-to-accelerator copies, and torch cannot "
              "pin memory without an accelerator (RuntimeError); on a CPU-only machine nothing is copied to an "
              "accelerator, so skipping the pinning changes no value")


def cpu_only_patches(method: str) -> list:
    """What is patched in llm-compressor for ``method`` on a machine without CUDA (each said in the results)."""
    import torch

    if method != "awq" or torch.cuda.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return [NO_PINNING]


def synced_seconds(device: str, fn):
    """(result of ``fn()``, wall seconds of the call), the accelerator synchronised before and after on CUDA."""
    import torch

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def run_llmcompressor(method, bits, group_size, model_dir, calib, out, device="cpu") -> dict:
    import llmcompressor
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe, load_quantizable_moe
    from transformers import AutoModelForCausalLM

    from jgptq_torch.cli.demo import byte_tokenizer

    recipe = lc_recipe(method, bits, group_size)
    patches = cpu_only_patches(method)
    t0 = time.perf_counter()
    if importlib.util.find_spec("torchvision") is not None:
        with load_quantizable_moe():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        moe_loading = "load_quantizable_moe"
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        linearize_moe(model)
        moe_loading = NO_TORCHVISION
    load_s = time.perf_counter() - t0
    tokenizer = byte_tokenizer()
    _, seconds = synced_seconds(device, lambda: oneshot(
        model=model, processor=tokenizer, dataset=_calib_loader(calib), recipe=recipe,
        num_calibration_samples=int(calib.shape[0]), max_seq_length=int(calib.shape[1]),
        shuffle_calibration_samples=False))
    quantized = sum(1 for _, m in model.named_modules() if hasattr(m, "weight_scale"))
    t0 = time.perf_counter()
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return {"quantize_s": seconds, "load_s": load_s, "save_s": time.perf_counter() - t0,
            "modules_quantized": quantized, "version": llmcompressor.__version__,
            "recipe": repr(recipe)[:2000],
            "settings": {"scheme": f"W{bits}A16", "symmetric": True, "group_size": 128, "batch_size": 1,
                         "moe_calibrate_all_experts": True, "ignore": IGNORE, "moe_loading": moe_loading,
                         "patches": patches, "device": device}}


def method_spec(spec: str) -> tuple:
    """``"gptq+calibration=all_experts+act_order=static"`` -> ``("gptq", {"calibration": "all_experts",
    "act_order": "static"})``: a jgptq method and overrides of its config fields (numbers parsed as such, ``true``
    and ``false`` as booleans)."""
    method, *rest = spec.split("+")
    overrides = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{spec!r}: {item!r} is not key=value")
        if value.lower() in ("true", "false"):
            overrides[key] = value.lower() == "true"
            continue
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                continue
        overrides[key] = value
    if not method:
        raise ValueError(f"{spec!r} names no method")
    return method, overrides


def run_jgptq(spec, bits, group_size, model_dir, calib, out, device="cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import jgptq
    from jgptq_torch.cli.demo import byte_tokenizer
    from jgptq_torch.export.checkpoint import export_model

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    method, overrides = method_spec(spec)
    opts = {"bits": bits, "group_size": group_size, "sym": True, "method": method, "scale_dtype": "float32",
            "batch_size": 16, "progress": False, **overrides}
    result, seconds = synced_seconds(device, lambda: jgptq.quantize_moe(model, calib, None, device=device, **opts))
    t0 = time.perf_counter()
    # a rerun (--redo, or a row whose result was lost) replaces the folder of an earlier one
    export_model(model, result, "compressed-tensors", out, tokenizer=byte_tokenizer(), overwrite=True)
    q = result.config.quant
    return {"quantize_s": seconds, "load_s": load_s, "save_s": time.perf_counter() - t0,
            "modules_quantized": len(result.weights), "version": jgptq.__version__,
            "stage_s": result.report.stage_totals(), "warnings": list(result.report.warnings),
            "prescale": {layer: {g: {k: v for k, v in d.items() if k != "priced"} for g, d in groups.items()}
                         for layer, groups in result.report.prescale.items()},
            "settings": {"method": method, "bits": q.bits, "symmetric": q.sym, "group_size": q.group_size,
                         "act_order": q.act_order, "damp": q.damp, "scale_dtype": q.scale_dtype,
                         "batch_size": opts["batch_size"], "moe_calibration": result.config.moe.calibration,
                         "overrides": overrides, "device": device,
                         "compilation_cache": os.environ.get("JGPTQ_COMPILATION_CACHE", "default")}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.peers_worker", description=__doc__.splitlines()[0])
    p.add_argument("--side", required=True, choices=("jgptq", "llmcompressor"))
    p.add_argument("--method", required=True)
    p.add_argument("--bits", type=int, required=True)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--model", required=True, help="the float model's folder")
    p.add_argument("--calib", required=True, help=".npy of int64 calibration windows (n, length)")
    p.add_argument("--out", required=True, help="the compressed-tensors folder to write")
    p.add_argument("--result", required=True, help="JSON written with the seconds (or the error)")
    p.add_argument("--device", default="cpu", help="torch device the quantization runs on: cpu or cuda")
    args = p.parse_args(argv)
    import numpy as np
    import torch

    torch.manual_seed(0)
    calib = torch.from_numpy(np.load(args.calib))
    run = run_jgptq if args.side == "jgptq" else run_llmcompressor
    try:
        res = run(args.method, args.bits, args.group_size, args.model, calib, args.out, args.device)
        res["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the error's text goes into the results, the benchmark goes on
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
               "traceback": traceback.format_exc()[-4000:]}
    res.update({"side": args.side, "method": args.method, "bits": args.bits, "threads": torch.get_num_threads()})
    with open(args.result, "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
