"""``jgptq quantize``: a local transformers model folder in, a quantized checkpoint folder out.

:mod:`jgptq_torch.cli.main` parses the options and enters the torch side through :func:`run` alone, which runs
:func:`run_quantize`, ``jgptq demo`` (:func:`jgptq_torch.cli.demo.run_demo`) or ``jgptq eval``
(:func:`jgptq_torch.cli.evaluate.run_eval`).

Steps: check every input (model folder, calibration text, output, that the exporter can hold the format, the
safetensors headers) before any work; load the tokenizer, cut the calibration text into windows and check their
count (:func:`jgptq_torch.pipeline.calib.window_shortfall`); load the model (safetensors only; remote code only when asked);
run :func:`jgptq_torch.pipeline.layerwise.quantize_moe` with its state in ``<OUT>.jgptq-work`` (a run killed
part-way continues from its last finished layer when started again with the same arguments; ``--offload disk``
puts the layer files in its ``offload`` folder unless ``--offload-dir`` says otherwise); export; write the
report (``<OUT>.report.json``) and a per-layer loss chart (``<OUT>.loss.svg``) beside the output; remove the
working folder. A failed write (a full disk) is one error naming the file and what the working folder keeps
(:mod:`jgptq_torch.write_errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import time
import warnings
from pathlib import Path

from jgptq_torch.cli import preflight
from jgptq_torch.cli.lock import output_lock, remove_leftovers
from jgptq_torch.cli.command_inputs import (CommandError, check_model_dir, check_output, log, model_dtype, parse_size,
                                    paths_for)
from jgptq.command_config import config_of
from jgptq.config import PipelineConfig, QuantConfig


MIN_SEQ_LEN = 16   # tokens per calibration window below which attention sees too little context to calibrate


def check_calibration_options(args) -> None:
    """Refuses ``--samples`` / ``--seq-len`` values no run can use, before the tokenizer or model is loaded."""
    if args.samples < 1:
        raise CommandError(f"--samples {args.samples}: the number of calibration sequences must be at least 1 "
                           f"(default: 128)")
    if args.seq_len < MIN_SEQ_LEN:
        raise CommandError(f"--seq-len {args.seq_len}: calibration windows need at least {MIN_SEQ_LEN} tokens "
                           f"(default: 512)")


def check_group_size(model_dir: Path, quant: QuantConfig, exclude) -> None:
    """Refuses an integer-grid group size that does not divide the model's ``hidden_size`` (read from
    config.json, without loading the model): the input width of the attention and expert projections.
    Skipped with ``--exclude`` (those may leave such projections out) or when config.json names no width."""
    if quant.is_ggml or quant.group_size == -1 or exclude:
        return
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    width = cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size")
    if not isinstance(width, int) or width % quant.group_size == 0:
        return
    fits = [g for g in (32, 64, 128) if width % g == 0]
    hint = f"--group-size {fits[-1]}" if fits else "--group-size -1 (one scale per output row)"
    raise CommandError(f"--group-size {quant.group_size} does not divide the model's hidden_size {width} "
                       f"(config.json), the input width of its attention and expert projections; use {hint}")


def build_config(args, dtype: str, work=None) -> PipelineConfig:
    """The pipeline configuration of the command-line options (:func:`jgptq.command_config.config_of`: scales
    stored as the exporter needs them, the format of a mix or a target, the ``target_*`` fields, a disk offload's
    folder in the working folder ``work``), checked against what the chosen exporter can hold.

    Raises:
      jgptq_torch.export.checkpoint.ExportError: a format the chosen exporter cannot hold; ValueError: an invalid option.
    """
    cfg = config_of(args, dtype, work)
    from jgptq_torch.export.checkpoint import check_format

    check_format(args.export, cfg.quant)   # say what the exporter holds before the run
    if args.gptq_names != "checkpoint" and args.export != "gptq":
        raise CommandError(f"--gptq-names {args.gptq_names} is for --export gptq (GPTQModel.load); {args.export} "
                           f"checkpoints keep the names their loaders read")
    return cfg


def size_to_bpw(model, size: str) -> float:
    """Bits per weight of ``--target-size`` over the decoder-layer targets of ``model``."""
    from jgptq_torch.pipeline.sensitivity import target_weights

    return parse_size(size) * 8 / target_weights(model)


@contextlib.contextmanager
def warnings_once():
    """Shows each warning raised inside once, as ``jgptq: warning: MESSAGE`` on stderr, as it comes (the library
    warns through :mod:`warnings`, which would add the calling line); yields the list of messages shown, which the
    final summary then leaves out. The warning filters stay as they are (``-W ignore`` still silences)."""
    shown: list = []

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text not in shown:
            shown.append(text)
            print(f"jgptq: warning: {text}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield shown


def layer_loss_chart(report, path, title: str) -> None:
    """Writes an SVG chart of the mean and largest GPTQ loss of each layer of ``report``."""
    import numpy as np

    from jgptq.plot import line_chart

    layers = sorted({r.layer for r in report.records if r.layer >= 0})   # -1: embeddings and head, no GPTQ loss
    mean, top = [], []
    for layer in layers:
        losses = [r.loss for r in report.records if r.layer == layer and np.isfinite(r.loss)]
        mean.append(float(np.mean(losses)) if losses else float("nan"))
        top.append(float(max(losses)) if losses else float("nan"))
    try:
        svg = line_chart({"mean": mean, "max": top}, x=layers, title=title, xlabel="decoder layer",
                         ylabel="GPTQ loss per matrix", log_y=True)
    except ValueError:  # nothing finite (a round-to-nearest run): no chart
        return
    Path(path).write_text(svg)


def bits_chart(report, path, title: str) -> None:
    """Writes an SVG chart of a target_bpw run's bits per weight per layer, one line per tensor group."""
    from jgptq.plot import line_chart

    import math

    series, layers = report.bits_by_layer()
    if series:   # every bits-per-weight value a group took is labelled (formats sit at uneven values: 4.5, 5.5, 8.5)
        chosen = sorted({round(v, 4) for vals in series.values() for v in vals if math.isfinite(v)})
        Path(path).write_text(line_chart(series, x=layers, title=title, xlabel="decoder layer",
                                         ylabel="bits per weight", y_ticks=chosen if len(chosen) <= 12 else None))


def run(args) -> int:
    """Runs a parsed command line of :mod:`jgptq_torch.cli.main` (``args.command``: ``"quantize"``, ``"demo"`` or
    ``"eval"``); returns the exit status. The command line's one door into the torch side."""
    if args.command == "eval":
        from jgptq_torch.cli.evaluate import run_eval

        return run_eval(args)
    if args.command == "demo":
        from jgptq_torch.cli.demo import run_demo

        return run_demo(args)
    return run_quantize(args)


def run_quantize(args) -> int:
    """The ``jgptq quantize`` command (``args``: the parsed options of :mod:`jgptq_torch.cli.main`): one run per
    output (:mod:`jgptq_torch.cli.lock`), its lock released however it ends."""
    with contextlib.ExitStack() as held:
        return _quantize(args, held)


def _quantize(args, held: contextlib.ExitStack) -> int:
    """:func:`run_quantize` with ``held``, where the output's lock goes once the options are checked."""
    t_start = time.perf_counter()
    model_dir = check_model_dir(args.model_dir)
    files = paths_for(args.out)
    dtype = model_dtype(model_dir, args.dtype)
    check_calibration_options(args)
    cfg = build_config(args, dtype, files["work"])   # a disk offload's layers beside the run's state, removed with it
    check_output(files["out"], args.overwrite)
    held.enter_context(output_lock(files["out"], args.quiet))   # a second run on this output stops here
    if args.export == "gguf":
        from jgptq_torch.export.gguf.export import output_path

        remove_leftovers([files["out"], output_path(files["out"])], args.quiet)
    else:
        remove_leftovers([files["out"]], args.quiet)
    max_shard = parse_size(args.max_shard_size)
    mode = load_mode(args, cfg)

    from jgptq_torch.pipeline import calib as calib_mod

    texts = calib_mod.read_texts(args.calib)
    check_group_size(model_dir, cfg.quant, args.exclude)   # still before the tokenizer and the model are loaded
    from jgptq_torch.pipeline.weight_checks import check_safetensors_files

    check_safetensors_files(model_dir)                      # truncated or garbled files, named, before loading
    preflight.check_device(args.device)
    if args.export == "gguf":
        preflight.check_gguf_model(model_dir, args.trust_remote_code)
    preflight.check_tokenizer_files(args.tokenizer or model_dir, given=args.tokenizer is not None)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # jgptq says what loads; transformers' bars would fill the log

    tok_dir = args.tokenizer or model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=args.trust_remote_code,
                                                  local_files_only=True)
    except Exception as exc:  # transformers raises several kinds here
        raise CommandError(f"no tokenizer could be loaded from {str(tok_dir)!r} ({type(exc).__name__}: {exc}); "
                           f"calibration text needs the model's tokenizer (or pass --tokenizer DIR)") from exc
    preflight.check_tokenizer(tokenizer, tok_dir)
    all_ids = calib_mod.text_tokens(texts, tokenizer)
    shortfall = calib_mod.window_shortfall(all_ids.numel(), args.seq_len, args.samples, args.calib)
    ids = calib_mod.cut_windows(all_ids, args.seq_len, args.samples)
    log(f"calibration: {ids.shape[0]} sequences, {ids.numel()} tokens from {args.calib}", args.quiet)

    if mode == "stream":
        return _stream(args, cfg, model_dir, files, dtype, ids, tokenizer, shortfall, max_shard, t_start)
    log(f"loading {model_dir} ({dtype})", args.quiet)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype) if args.dtype != "auto" else "auto", use_safetensors=True,
        trust_remote_code=args.trust_remote_code, local_files_only=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if getattr(args, "target_size", None) is not None:
        cfg = PipelineConfig.build(cfg, target_bpw=size_to_bpw(model, args.target_size))
        log(f"--target-size {args.target_size}: {cfg.target_bpw:.4f} bits per weight", args.quiet)
    if args.export == "gguf":  # refuse what the GGUF exporter cannot write before the run, not after it
        from jgptq_torch.export.gguf.export import check_exportable

        try:
            check_exportable(model, tokenizer)
        except NotImplementedError as exc:
            raise CommandError(str(exc)) from exc

    from jgptq_torch.export.checkpoint import export_model
    from jgptq_torch.pipeline.layerwise import quantize_moe
    from jgptq_torch.write_errors import WriteError, failure_message, writing

    try:
        with warnings_once() as shown:
            if shortfall:
                warnings.warn(shortfall, stacklevel=1)
            sink = None
            if args.export == "gguf":   # written layer by layer while the run goes
                from jgptq_torch.export.gguf.stream import GGUFSink

                sink = GGUFSink(files["out"], overwrite=args.overwrite, tokenizer=tokenizer,
                                float_embeddings=bool(getattr(args, "float_embeddings", False)))
                log(f"writing gguf to {files['out']} as the layers finish", args.quiet)
            result = quantize_moe(model, ids, cfg, device=device, checkpoint_dir=files["work"], resume=args.resume,
                                  sink=sink)
            if sink is None:
                log(f"exporting {args.export} to {files['out']}", args.quiet)
                with writing(files["out"]):
                    export_model(model, result, args.export, files["out"], overwrite=args.overwrite,
                                 tokenizer=tokenizer, source_dir=args.tokenizer or model_dir,
                                 max_shard_bytes=max_shard, **({"names": args.gptq_names} if args.export == "gptq"
                                                               else {}))
    except WriteError as exc:  # a full disk: the path, what is kept, how to go on
        raise CommandError(failure_message(exc, files["work"])) from exc
    return _finish(args, cfg, model_dir, files, result, shortfall, shown, t_start)


def load_mode(args, cfg) -> str:
    """``--load``: ``stream`` (any export, GGUF included) unless the run needs the whole model (a bits budget,
    whose first pass measures every layer before any is written; GPTQ module names), which is said; an explicit
    ``--load stream`` for such a run is refused."""
    needs = ("--target-bpw/--target-size" if cfg.target_bpw is not None or getattr(args, "target_size", None)
             else "--gptq-names modules" if args.export == "gptq" and args.gptq_names == "modules" else None)
    if args.load == "stream" and needs:
        raise CommandError(f"--load stream cannot serve {needs}, which needs the whole model; use --load all")
    if args.load is None and needs:
        log(f"{needs} needs the whole model: loading it (--load all)", args.quiet)
        return "all"
    return args.load or "stream"


def _stream(args, cfg, model_dir, files, dtype, ids, tokenizer, shortfall, max_shard, t_start) -> int:
    """``jgptq quantize`` with ``--load stream``: :func:`jgptq_torch.source.stream.quantize_folder`."""
    import torch

    from jgptq_torch.source.stream import quantize_folder

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    options = {}
    if args.export == "gguf":   # one file: no shards; refuse what the exporter cannot write before the run
        preflight.check_gguf_tokenizer(model_dir, tokenizer, args.trust_remote_code)
        options, max_shard = {"float_embeddings": bool(getattr(args, "float_embeddings", False))}, None
    log(f"streaming {model_dir} ({dtype}) layer by layer; writing {args.export} to {files['out']} as the layers "
        f"finish", args.quiet)
    from jgptq_torch.write_errors import WriteError, failure_message, writing

    try:
        with warnings_once() as shown, writing(files["out"]):
            if shortfall:
                warnings.warn(shortfall, stacklevel=1)
            result = quantize_folder(model_dir, ids, files["out"], cfg, export=args.export, tokenizer=tokenizer,
                                     device=device, dtype=getattr(torch, dtype), checkpoint_dir=files["work"],
                                     resume=args.resume, overwrite=args.overwrite,
                                     trust_remote_code=args.trust_remote_code, max_shard_bytes=max_shard,
                                     export_options=options)
    except WriteError as exc:  # a full disk: the path, what is kept, how to go on (as the loaded path says it)
        raise CommandError(failure_message(exc, files["work"])) from exc
    return _finish(args, cfg, model_dir, files, result, shortfall, shown, t_start)


def _finish(args, cfg, model_dir, files, result, shortfall, shown, t_start) -> int:
    """The report, its charts and the closing lines of a finished run."""
    from jgptq_torch.write_errors import WriteError, failure_message, writing

    if shortfall:
        result.report.warnings.insert(0, shortfall)
    try:
        with writing(files["report"]):
            result.report.to_json(str(files["report"]))
        with writing(files["plot"]):
            layer_loss_chart(result.report, files["plot"], f"{model_dir.name}: GPTQ loss per layer")
        if cfg.target_bpw:
            with writing(files["bits"]):
                bits_chart(result.report, files["bits"], f"{model_dir.name}: bits per weight chosen for "
                                                         f"{cfg.target_bpw:g} bpw")
    except WriteError as exc:
        raise CommandError(failure_message(exc, files["work"], written=files["out"])) from exc
    shutil.rmtree(files["work"], ignore_errors=True)
    unshown = [w for w in result.report.warnings if w not in shown]   # the report file keeps them all
    print(dataclasses.replace(result.report, warnings=unshown).summary())
    print(f"wrote {files['out']} ({args.export}), report {files['report']}"
          + (f", chart {files['plot']}" if files["plot"].exists() else "")
          + (f", bits chart {files['bits']}" if files["bits"].exists() else "")
          + f" in {time.perf_counter() - t_start:.1f} s")
    return 0
