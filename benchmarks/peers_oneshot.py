"""End to end beside llm-compressor: its own ``oneshot`` (GPTQModifier W4A16) and jgptq.quantize_moe on one model.

The model is the Qwen3-30B-A3B-shaped one of ``benchmarks/moe_model.py`` (its builder, random bf16 weights) at a
reduced depth; calibration the same 128 x 2048 random tokens for both. In one process:

1. jgptq: ``quantize_moe`` as ``moe_model`` runs it (int4 group 128 symmetric, batch 16, layers offloaded to host
   memory, routed tokens only, natural order), timed whole.
2. The original weights are restored, the model moved to host memory (where ``from_pretrained`` leaves a model),
   the fused experts linearized with llm-compressor's own ``linearize_moe`` (timed apart: ``oneshot`` would do it
   itself), then ``oneshot(recipe=GPTQModifier(scheme="W4A16", ignore=[lm_head, routers]), pipeline="sequential",
   sequential_offload_device="cpu")`` with settings matched to jgptq: ``moe_calibrate_all_experts=False`` (each
   expert sees its routed tokens only), ``batch_size=16``, ``actorder=None``.
3. With ``--defaults-layers N`` (N > 0) a fresh model of N layers through ``oneshot`` with llm-compressor's own
   defaults (every expert calibrated on every token, batch 1, static activation order).

Reported: seconds a layer for each, the ratios (llm-compressor over jgptq), the linearization apart, how many
modules each side quantized (jgptq counts solve records: a fused gate_up of all experts is one). ``oneshot``
re-reads the model's config from ``config.name_or_path``, so the config is saved to a temporary folder first, as
if the model had been loaded from there. The calibration tokens reach ``oneshot`` as a DataLoader of
``input_ids``; it still asks for a tokenizer object, so a small word-level one is built in memory (it is not used
to tokenize anything). The jgptq figure includes compiling its solves in layer 0 (``layer_s`` per layer); a second
``quantize_moe`` of the restored weights in the same process (``jgptq_second_run``, ``ratio_matched_second_run``) runs
its programs already compiled.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from benchmarks import common

DOC = __doc__.splitlines()[0]


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    words["[UNK]"] = vocab
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="[UNK]")),
                                   unk_token="[UNK]")


def _loader(calib, batch):
    import torch

    rows = [{"input_ids": calib[i], "attention_mask": torch.ones_like(calib[i])} for i in range(calib.shape[0])]
    return torch.utils.data.DataLoader(rows, batch_size=batch, shuffle=False)


def run_oneshot(model, calib, s, *, matched: bool, sync) -> dict:
    """llm-compressor's ``oneshot`` on ``model`` (on the host); seconds for linearizing and for oneshot."""
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.gptq import GPTQModifier

    # oneshot re-reads the model's config from ``config.name_or_path`` (as for a model loaded from a folder)
    folder = tempfile.mkdtemp(prefix="peers_oneshot_")
    model.config.save_pretrained(folder)
    model.config.name_or_path = folder
    t0 = time.perf_counter()
    linearize_moe(model)
    linearize_s = time.perf_counter() - t0
    kwargs = {"actorder": None} if matched else {}
    recipe = GPTQModifier(scheme="W4A16", targets="Linear", ignore=["lm_head", "re:.*mlp.gate$"], **kwargs)
    batch = s["batch"] if matched else 1
    t0 = time.perf_counter()
    oneshot(model=model, processor=_tokenizer(s["vocab"]), dataset=_loader(calib, batch), recipe=recipe,
            num_calibration_samples=calib.shape[0], max_seq_length=calib.shape[1], batch_size=batch,
            pipeline="sequential", sequential_offload_device="cpu", moe_calibrate_all_experts=not matched,
            shuffle_calibration_samples=False)
    sync()
    seconds = time.perf_counter() - t0
    shutil.rmtree(folder, ignore_errors=True)
    quantized = sum(1 for _, m in model.named_modules() if hasattr(m, "weight_scale"))
    return {"linearize_s": linearize_s, "oneshot_s": seconds, "modules_quantized": quantized,
            "settings": ({"moe_calibrate_all_experts": False, "batch_size": batch, "actorder": None}
                         if matched else {"moe_calibrate_all_experts": True, "batch_size": 1,
                                          "actorder": "static (GPTQModifier default)"})}


def main(argv=None):
    p = common.parser("peers_oneshot", DOC)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --small 2)")
    p.add_argument("--defaults-layers", type=int, default=0,
                   help="also run oneshot with llm-compressor's defaults on a model of this many layers (0: skip)")
    args = p.parse_args(argv)
    if os.environ.get("OUT") and args.out == os.path.join(common.RESULTS, "peers_oneshot.json"):
        args.out = os.path.join(os.environ["OUT"], "peers_oneshot_h200.json")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jgptq  # noqa: F401  (sets the JAX allocator before JAX starts)
    import torch

    from benchmarks.anchors import side_by_side as sbs
    from benchmarks.moe_model import FULL, SMALL, build_model
    from jgptq import QuantConfig

    s = SMALL if args.small else FULL
    layers = args.layers or (2 if args.small else 4)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False

    def sync():
        if cuda:
            torch.cuda.synchronize()

    out = {"benchmark": "peers_oneshot", "description": __doc__, "small": bool(args.small), "shape": s,
           "layers": layers, "device": device, "packages": sbs.package_versions()}
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, s["vocab"], (s["sequences"], s["length"]), generator=g)
    model = build_model(s, layers, device)
    originals = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    quant = QuantConfig(bits=4, group_size=s["group"], block_size=s["group"], sym=True, act_order="none")

    def quantize():  # (seconds, result) of one quantize_moe of the model as it stands
        sync()
        t0 = time.perf_counter()
        result = jgptq.quantize_moe(model, calib, quant, device=device, batch_size=s["batch"],
                                    hessian_dtype="bfloat16", progress=False, offload="cpu")
        sync()
        return time.perf_counter() - t0, result

    jg_s, result = quantize()
    stages = result.report.stage_totals()
    per_layer = [sum(result.report.timings.get(i, {}).values()) for i in range(layers)]
    out["jgptq"] = {"total_s": jg_s, "seconds_per_layer": jg_s / layers, "stage_s": stages,
                    "layer_s": per_layer,  # layer 0 includes compiling every solve shape
                    "seconds_per_layer_after_first": (sum(per_layer[1:]) / (layers - 1) if layers > 1 else None),
                    "solve_records": len(result.report.records),
                    "settings": {"routed_tokens_only": True, "batch_size": s["batch"], "act_order": "none"}}
    print({"jgptq_s": jg_s, "stages": stages}, flush=True)
    del result
    common.write(args.out, out)

    # A second run in the same process: every program compiled, as for each further model a process quantizes.
    model.load_state_dict(originals)
    again_s, result = quantize()
    out["jgptq_second_run"] = {"total_s": again_s, "seconds_per_layer": again_s / layers,
                               "stage_s": result.report.stage_totals()}
    del result

    t0 = time.perf_counter()
    model.load_state_dict(originals)
    model.to("cpu")
    del originals
    if cuda:
        torch.cuda.empty_cache()
    out["restore_to_host_s"] = time.perf_counter() - t0
    try:
        lc = run_oneshot(model, calib, s, matched=True, sync=sync)
        lc["seconds_per_layer"] = lc["oneshot_s"] / layers
        lc["seconds_per_layer_with_linearize"] = (lc["oneshot_s"] + lc["linearize_s"]) / layers
        out["llmcompressor_matched"] = lc
        out["ratio_matched"] = lc["seconds_per_layer"] / out["jgptq"]["seconds_per_layer"]
        jg_layer = out["jgptq"]["seconds_per_layer"]
        out["ratio_matched_with_linearize"] = lc["seconds_per_layer_with_linearize"] / jg_layer
        out["ratio_matched_second_run"] = lc["seconds_per_layer"] / out["jgptq_second_run"]["seconds_per_layer"]
        print({k: out[k] for k in ("ratio_matched", "ratio_matched_with_linearize")}, lc, flush=True)
    except Exception as exc:  # recorded: jgptq's figures above stand on their own
        out["llmcompressor_matched"] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
    del model
    common.write(args.out, out)

    if args.defaults_layers > 0:
        if cuda:
            torch.cuda.empty_cache()
        try:
            model = build_model(s, args.defaults_layers, device).to("cpu")
            lc = run_oneshot(model, calib, s, matched=False, sync=sync)
            lc["layers"] = args.defaults_layers
            lc["seconds_per_layer"] = lc["oneshot_s"] / args.defaults_layers
            out["llmcompressor_defaults"] = lc
            out["ratio_defaults"] = lc["seconds_per_layer"] / out["jgptq"]["seconds_per_layer"]
            print({"ratio_defaults": out["ratio_defaults"]}, lc, flush=True)
        except Exception as exc:
            out["llmcompressor_defaults"] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
        common.write(args.out, out)
    return 0
