"""The ``jgptq`` command line.

    jgptq demo                                   # a tiny MoE model, GPTQ against round-to-nearest, in seconds
    jgptq quantize MODEL_DIR --calib text.txt --out OUT [--export compressed-tensors] [--bits 4 ...]
    jgptq eval QUANTIZED --float MODEL_DIR [--text held_out.txt] [--json out.json]

``jgptq quantize`` quantizes a local transformers model folder (safetensors weights) with GPTQ, layer by layer,
and writes a checkpoint that serving stacks load. A run that is killed continues from its last finished layer
when started again with the same arguments (``--no-resume`` starts over). Run ``jgptq quantize --help`` for every
option. The torch side is imported only when a command runs; parsing and ``--version`` need neither torch nor
JAX (``--help`` imports the GGML codecs, hence JAX, to list the formats it can encode).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap

from jgptq.config import QuantConfig
from jgptq.mixes import PRESETS
from jgptq.options import add_options
from jgptq.version import __version__

EXPORTS = ("compressed-tensors", "gptq", "gguf")
DEMO_EXPORTS = ("compressed-tensors", "gptq")   # the demo quantizes to integer grids, which GGUF does not hold

EPILOG = """examples:
  jgptq demo
  jgptq quantize ./Qwen3-30B-A3B --calib calib.txt --out ./Qwen3-30B-A3B-w4g128
  jgptq quantize ./model --calib texts/ --out ./model-gptq --export gptq --bits 4 --group-size 128 --act-order desc
  jgptq quantize ./model --calib texts/ --out ./model-w3 --bits 3 --asym --calibration all_experts --device cuda
  jgptq quantize ./big-model --calib calib.txt --out ./big-w4 --offload disk --device-budget 40GB
  jgptq quantize ./model --calib calib.txt --out ./model-Q4_K_M.gguf --export gguf --mix q4_k_m
  jgptq eval ./Qwen3-30B-A3B-w4g128 --float ./Qwen3-30B-A3B --text held_out.txt --json eval.json
  jgptq eval ./model-Q4_K_M.gguf --float ./model-f32.gguf --text held_out.txt
  jgptq quantize ./model --calib calib.txt --out ./model-2.5bpw.gguf --export gguf --target-bpw 2.5
"""


def format_listing() -> str:
    """The GGML formats jgptq can encode (from :mod:`jgptq.ggml`'s registry) and the llama.cpp mixes
    (:data:`jgptq.mixes.PRESETS`), as help text. Imports the codecs, hence JAX: called only when help is shown."""
    from jgptq.ggml import format_names, get_format

    formats = [name for name in format_names() if get_format(name).encode is not None]
    mixes = [f"{mix} (on {base})" for mix, base in PRESETS.items()]
    return "".join(textwrap.fill(line, width=100, subsequent_indent="  ") + "\n" for line in (
        f"GGML formats (--format, --tensor-format; for --export gguf): {', '.join(formats)}",
        f"llama.cpp mixes (--mix; for --export gguf): {', '.join(mixes)}"))


class _Parser(argparse.ArgumentParser):
    """An argument parser whose help can end with :func:`format_listing`, built only when help is printed (so
    that parsing imports no JAX)."""

    def __init__(self, *args, lists_formats: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.lists_formats = lists_formats

    def format_help(self) -> str:
        text = super().format_help()
        return text + "\n" + format_listing() if self.lists_formats else text


def default(config_class, field: str):
    """The default of ``field`` of the config dataclass ``config_class``: an option for a config field takes its
    default from there, never from a copy."""
    for f in dataclasses.fields(config_class):
        if f.name == field:
            return f.default
    raise KeyError(f"{config_class.__name__} has no field {field!r}")


TRACEBACK_HELP = "show the full traceback of an error"


def _traceback_option(p: argparse.ArgumentParser) -> None:
    """``--traceback`` after the subcommand too; left unset there, so that one before it still counts."""
    p.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=TRACEBACK_HELP)


def _quant_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("quantization")
    add_options(g, "quant.format", "quant.bits", "quant.group_size", "quant.sym", "quant.act_order", "quant.damp",
                "method", "mix", "formats", "importance", "imatrix_source", "target_bpw")
    g.add_argument("--target-size", metavar="SIZE",
                   help="the same budget as bytes of the decoder layers' quantized tensors, e.g. 24GB")
    add_options(g, "target_formats", "target_gain", "block_fallback")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = _Parser(
        lists_formats=True, prog="jgptq",
        description="GPTQ for Mixture-of-Experts language models, with the numerics in JAX.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jgptq {__version__}")
    parser.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    q = sub.add_parser("quantize", lists_formats=True,
                       help="quantize a local transformers model folder and export it",
                       description="Quantize a local transformers model folder (safetensors) with GPTQ, layer by "
                                   "layer, and export a checkpoint. Killed runs resume from the last finished layer.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("model_dir", metavar="MODEL_DIR", help="local transformers model folder")
    q.add_argument("--calib", required=True, metavar="FILE_OR_DIR",
                   help="calibration text: a UTF-8 file, or a folder of .txt files")
    q.add_argument("--out", required=True, help="output checkpoint folder (or .gguf file for --export gguf)")
    q.add_argument("--export", choices=EXPORTS, default="compressed-tensors",
                   help="checkpoint format (default: compressed-tensors)")
    q.add_argument("--float-embeddings", action="store_true",
                   help="--export gguf: keep token_embd and output in floating point (default: the types llama.cpp "
                        "gives them for the run's mix or format, e.g. q4_k and q6_k for q4_k_m)")
    q.add_argument("--gptq-names", choices=("checkpoint", "modules"), default="checkpoint",
                   help="--export gptq: tensor names as save_pretrained writes them, which transformers and vLLM read "
                        "(default), or the model's module names with experts split per expert, which GPTQModel.load "
                        "needs for Mixtral")
    _quant_options(q)
    c = q.add_argument_group("calibration")
    add_options(c, "moe.calibration", "moe.min_tokens", "moe.router_weighting")
    c.add_argument("--samples", type=int, default=128, help="calibration sequences (default: 128)")
    add_options(c, "max_length", "batch_size")
    c.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: MODEL_DIR)")
    r = q.add_argument_group("run")
    r.add_argument("--device", help="torch device each layer runs on (default: cuda if available, else cpu)")
    r.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="dtype the model is loaded in (default: auto, the checkpoint's)")
    r.add_argument("--load", choices=("stream", "all"), default=None,
                   help="stream: read each decoder layer from MODEL_DIR when its turn comes and write the output "
                        "as layers finish (host memory holds about two layers); all: load the whole model first "
                        "(from_pretrained; --offload applies). Default: stream (every export, GGUF included), or all "
                        "where the run needs the whole model (--target-bpw/--target-size, --gptq-names modules), "
                        "which is said")
    add_options(r, "hessian_dtype", "exclude", "offload", "offload_dir", "device_budget")
    r.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    r.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model folder's own Python code to run (off unless given)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing output")
    r.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue a killed run from its last finished layer (default: on)")
    add_options(r, "progress")
    _traceback_option(r)

    bits = default(QuantConfig, "bits")
    d = sub.add_parser("demo", help="quantize a tiny random MoE model: GPTQ against round-to-nearest",
                       description="Build a tiny Qwen3-MoE model with random weights, calibrate it on text shipped "
                                   "with jgptq, quantize it with GPTQ and with round-to-nearest, compare both with "
                                   "the float model on held-out text, and export the GPTQ model.")
    d.add_argument("--out", help="output checkpoint folder, kept (default: a temporary folder, removed at the end)")
    d.add_argument("--export", choices=DEMO_EXPORTS, default="compressed-tensors",
                   help="checkpoint format of the integer-grid demo (default: compressed-tensors)")
    d.add_argument("--bits", type=int, default=bits, help=f"bits per weight (default: {bits})")
    d.add_argument("--group-size", type=int, default=32, help="input columns per scale (default: 32)")
    d.add_argument("--layers", type=int, default=4, help="decoder layers of the demo model (default: 4)")
    d.add_argument("--samples", type=int, default=64, help="calibration sequences of 128 bytes (default: 64)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    d.add_argument("--overwrite", action="store_true", help="replace an existing output")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    _traceback_option(d)
    _eval_parser(sub)
    return parser


def _eval_parser(sub) -> None:
    from jgptq.evaluation import DEFAULT_N_CTX

    e = sub.add_parser("eval", help="KL to the float model, top-1 agreement and perplexity of a quantized model",
                       description=textwrap.fill("Compare a quantized model with its float model on held-out text as "
                                   "llama-perplexity --kl-divergence does: windows of --n-ctx tokens, each from an "
                                   "empty context, the second half of each scored. Prints KL(float || quantized) "
                                   "(mean with standard error, median, p90, p99, max), the top-1 agreement and both "
                                   "perplexities. GGUF files run in llama.cpp (pip install llama-cpp-python); give "
                                   "an F32 GGUF of the float model as --float for a like-for-like comparison.", width=100),
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("quantized", metavar="QUANTIZED", help="quantized model: a jgptq output folder or a .gguf file")
    e.add_argument("--float", dest="float_model", required=True, metavar="MODEL",
                   help="its float model: a transformers folder, or a float .gguf file")
    e.add_argument("--text", metavar="FILE_OR_DIR",
                   help="held-out text: a UTF-8 file or a folder of .txt files (default: jgptq's held-out demo "
                        "text, a quick check only)")
    e.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX,
                   help=f"tokens per window (default: {DEFAULT_N_CTX}, llama-perplexity's)")
    e.add_argument("--windows", type=int, help="evaluate at most this many windows (default: all the text gives)")
    e.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer folder (default: the float model folder, else the quantized one, else the float "
                        "GGUF's vocabulary)")
    e.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    e.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    e.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="dtype transformers folders load in (default: auto, the checkpoint's)")
    e.add_argument("--batch-size", type=int, default=4, help="windows per torch forward (default: 4)")
    e.add_argument("--threads", type=int, help="llama.cpp threads (default: every core)")
    e.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model folders' own Python code to run (off unless given)")
    e.add_argument("--quiet", action="store_true", help="no progress messages")
    _traceback_option(e)


def main(argv=None) -> int:
    """Entry point of the ``jgptq`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        from jgptq_torch.gpu_sharing import share_gpu_with_torch

        share_gpu_with_torch()
        from jgptq_torch.cli.command import run
        from jgptq.surface import command_line

        with command_line():   # messages name the flags (--overwrite), not the Python arguments
            return run(args)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in ("torch", "transformers", "tokenizers"):
            print(f"jgptq: error: 'jgptq {args.command}' runs transformers models and needs {exc.name}; install "
                  f"them with: pip install 'jgptq[torch]'", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print("jgptq: interrupted; run the same command again to continue from the last finished layer",
              file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # bad input: a clear message, no traceback
        if args.traceback or os.environ.get("JGPTQ_TRACEBACK"):
            raise
        print(f"jgptq: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
