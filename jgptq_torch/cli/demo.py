"""``jgptq demo``: GPTQ against round-to-nearest on a tiny Mixture-of-Experts model, start to finish, offline.

1. builds a small Qwen3-MoE model with random weights (no download) and a byte-level tokenizer (256 tokens);
2. cuts the text shipped in ``jgptq/data/calibration.txt`` into 128-byte windows: the first 80 % calibrate,
   the last 20 % are held out (:func:`jgptq.evaluation.demo_texts`, also ``jgptq eval``'s default text);
3. quantizes one copy with GPTQ and one with round-to-nearest (RTN) on the same grids;
4. compares both with the float model on the held-out text: next-token KL divergence and top-1 agreement at every
   position that has a next token (:func:`jgptq.evaluation.token_stats`), and the relative error of every decoder
   layer's output;
5. exports the GPTQ model (compressed-tensors by default) with its tokenizer, writes the report and a per-layer
   chart beside it, and loads the checkpoint back with transformers to check that it holds the quantized model.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SEQ_LEN = 128


def byte_tokenizer():
    """A transformers fast tokenizer whose 256 tokens are the 256 byte values (token id = byte value)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level pre-tokenization shows every byte as one printable character: printable Latin-1 bytes as
    # themselves, the others as the characters from U+0100 on, in byte order.
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 20)


def tiny_moe(layers: int = 4, seed: int = 0, **overrides):
    """A float32 Qwen3-MoE causal LM with random weights: hidden 128, 8 experts (top-2) of width 64, 256 tokens."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(vocab_size=256, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
               num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()


def _layer_outputs(model, ids) -> tuple:
    """(logits float64 (N, S, V), [output of every decoder layer]) of one forward."""
    from jgptq_torch.models import find_decoder_layers

    _, layers = find_decoder_layers(model)
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o)
                                                                      .double()))
             for layer in layers]
    try:
        with torch.no_grad():
            logits = model(ids).logits.double()
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


def compare(reference, quantized, ids) -> dict:
    """Next-token KL(reference || quantized) and top-1 agreement (means over every position of ``ids`` (N, S) that
    has a next token, by :func:`jgptq.evaluation.token_stats`), and per-layer relative output error
    ||y_q - y||^2 / ||y||^2, from two :func:`_layer_outputs` results."""
    from jgptq.evaluation import token_stats

    (lf, hf), (lq, hq) = reference, quantized
    vocab = lf.shape[-1]
    stats = token_stats(lf[:, :-1].reshape(-1, vocab).numpy(), lq[:, :-1].reshape(-1, vocab).numpy(),
                        ids[:, 1:].reshape(-1).numpy())
    err = [float(((b - a) ** 2).sum() / (a**2).sum()) for a, b in zip(hf, hq)]
    return {"kl": float(stats["kl"].mean()), "top1": float(stats["same_top"].mean()), "layer_error": err}


def _mean_loss_by_layer(report, layers: int) -> list:
    out = []
    for layer in range(layers):
        losses = [r.loss for r in report.records if r.layer == layer and np.isfinite(r.loss)]
        out.append(float(np.mean(losses)) if losses else float("nan"))
    return out


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_demo(args) -> int:
    """The ``jgptq demo`` command (``args``: the parsed options of :mod:`jgptq_torch.cli.main`). Without ``--out`` it writes
    into a new temporary folder and removes it at the end, whether the run succeeds or fails."""
    if args.out:
        return _run_demo(args, Path(args.out))
    scratch = Path(tempfile.mkdtemp(prefix="jgptq-demo-"))
    try:
        return _run_demo(args, scratch / "tiny-qwen3-moe-gptq")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_demo(args, out: Path) -> int:
    from jgptq_torch.pipeline import calib as calib_mod
    from jgptq_torch.cli.command_inputs import check_output, log, paths_for
    from jgptq_torch.export.checkpoint import check_format, export_model
    from jgptq_torch.pipeline.layerwise import quantize_moe
    from jgptq.config import PipelineConfig
    from jgptq.evaluation import HELD_OUT_FRACTION, demo_texts
    from jgptq.plot import line_chart

    t_start = time.perf_counter()
    scale_dtype = "float16" if args.export == "gptq" else "float32"   # the demo model is float32
    cfg = PipelineConfig.build(None, bits=args.bits, group_size=args.group_size, scale_dtype=scale_dtype,
                               batch_size=16, progress=not args.quiet)
    check_format(args.export, cfg.quant)
    check_output(out, args.overwrite)
    files = paths_for(out)

    tokenizer = byte_tokenizer()
    calib_text, held_text = demo_texts()
    calib = calib_mod.token_windows([calib_text], tokenizer, SEQ_LEN, args.samples)
    held = calib_mod.token_windows([held_text], tokenizer, SEQ_LEN, 10**6)
    model = tiny_moe(args.layers, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    reference = copy.deepcopy(model)
    log(f"tiny Qwen3-MoE: {args.layers} layers x 8 experts, {n_params / 1e6:.2f} M parameters; calibration "
        f"{calib.shape[0]} x {SEQ_LEN} bytes, held out {held.shape[0]} x {SEQ_LEN}", args.quiet)

    runs = {}
    for method, target in (("rtn", copy.deepcopy(reference)), ("gptq", model)):
        log(f"quantizing with {method.upper()} ({args.bits}-bit, group {args.group_size})", args.quiet)
        t0 = time.perf_counter()
        result = quantize_moe(target, calib, cfg, method=method)
        runs[method] = (target, result, time.perf_counter() - t0)
    float_out = _layer_outputs(reference, held)
    scores = {m: compare(float_out, _layer_outputs(target, held), held) for m, (target, _, _) in runs.items()}

    gptq_model, gptq_result, _ = runs["gptq"]
    log(f"exporting {args.export} to {out}", args.quiet)
    export_model(gptq_model, gptq_result, args.export, out, overwrite=args.overwrite, tokenizer=tokenizer)
    gptq_result.report.to_json(str(files["report"]))
    losses = _mean_loss_by_layer(gptq_result.report, args.layers)
    files["plot"].write_text(line_chart(
        {"RTN": scores["rtn"]["layer_error"], "GPTQ": scores["gptq"]["layer_error"]},
        title=f"Per-layer output error on held-out text ({args.bits}-bit, group {args.group_size})",
        xlabel="decoder layer", ylabel="relative squared error", log_y=True))
    reload_line = _reload_check(out, args.export, gptq_model, held)

    rtn, gq = scores["rtn"], scores["gptq"]
    lines = [
        "",
        f"jgptq demo: tiny Qwen3-MoE with random weights ({args.layers} layers, 8 experts, top-2, hidden 128, "
        f"{n_params / 1e6:.2f} M parameters)",
        f"calibration {calib.shape[0]} x {SEQ_LEN} bytes of jgptq/data/calibration.txt; held out "
        f"{held.shape[0]} x {SEQ_LEN} bytes (its last {HELD_OUT_FRACTION:.0%}); grid {args.bits}-bit, group "
        f"{args.group_size}, symmetric",
        "",
        f"{'':24}{'RTN':>12}{'GPTQ':>12}",
        f"{'next-token KL':24}{rtn['kl']:>12.3e}{gq['kl']:>12.3e}    GPTQ / RTN = {gq['kl'] / rtn['kl']:.2f}",
        f"{'top-1 agreement':24}{rtn['top1']:>11.1%} {gq['top1']:>11.1%}",
        f"{'seconds':24}{runs['rtn'][2]:>12.1f}{runs['gptq'][2]:>12.1f}    (JAX compilation included)",
        "",
        f"{'layer':>5}{'output error RTN':>20}{'output error GPTQ':>20}{'GPTQ loss (mean)':>20}",
    ]
    for i in range(args.layers):
        lines.append(f"{i:>5}{rtn['layer_error'][i]:>20.3e}{gq['layer_error'][i]:>20.3e}{losses[i]:>20.3e}")
    size = f", {_folder_bytes(out) / 1e6:.2f} MB" if out.is_dir() else ""
    if args.out:
        kept = [f"checkpoint: {out} ({args.export}{size})", f"report: {files['report']}",
                f"per-layer chart: {files['plot']}"]
    else:
        kept = [f"checkpoint: {args.export}{size}, written to a temporary folder and removed with its report and "
                f"chart (pass --out DIR to keep them)"]
    lines += ["", *kept, reload_line, f"total {time.perf_counter() - t_start:.1f} s"]
    print("\n".join(lines))
    sys.stdout.flush()
    return 0


def _reload_check(out: Path, kind: str, model, ids) -> str:
    """Loads a compressed-tensors export back with transformers and compares its logits with ``model``'s."""
    if kind == "gptq":
        return ("reload check: skipped (transformers' GPTQ loader would leave this MoE model's fused experts random; "
                "GPTQModel.load reads the checkpoint)")
    if kind != "compressed-tensors":
        return f"reload check: skipped (transformers needs an extra package to load {kind} checkpoints)"
    if importlib.util.find_spec("compressed_tensors") is None:
        return "reload check: skipped (pip install compressed-tensors to load the checkpoint with transformers)"
    import contextlib
    import io
    import logging
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("compressed_tensors").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # the loader's own bars
            warnings.simplefilter("ignore")
            loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
            with torch.no_grad():
                diff = float((loaded(ids).logits - model(ids).logits).abs().max())
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return (f"reloaded with transformers: logits {'equal' if diff == 0 else 'differ from'} the quantized model's "
            f"(max |difference| {diff:.3g})")
