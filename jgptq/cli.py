"""The ``jgptq`` command line.

    jgptq demo                                   # a tiny MoE model, GPTQ against round-to-nearest, in seconds
    jgptq quantize MODEL_DIR --calib text.txt --out OUT [--export compressed-tensors] [--bits 4 ...]

``jgptq quantize`` quantizes a local transformers model folder (safetensors weights) with GPTQ, layer by layer,
and writes a checkpoint that serving stacks load. A run that is killed continues from its last finished layer
when started again with the same arguments (``--no-resume`` starts over). Run ``jgptq quantize --help`` for every
option. The torch side is imported only when a command runs; ``--help`` and ``--version`` need neither torch
nor JAX.
"""

from __future__ import annotations

import argparse
import os
import sys

EXPORTS = ("compressed-tensors", "gptq", "gguf")
ACT_ORDERS = ("none", "desc", "static", "group_aware")
MIXES = ("q4_k_m", "q5_k_m", "q4_k_s", "q5_k_s", "q3_k_m", "q6_k")  # jgptq.mixes.PRESETS (kept import-free)

EPILOG = """examples:
  jgptq demo
  jgptq quantize ./Qwen3-30B-A3B --calib calib.txt --out ./Qwen3-30B-A3B-w4g128
  jgptq quantize ./model --calib texts/ --out ./model-gptq --export gptq --bits 4 --group-size 128 --act-order desc
  jgptq quantize ./model --calib texts/ --out ./model-w3 --bits 3 --asym --calibration all_experts --device cuda
  jgptq quantize ./big-model --calib calib.txt --out ./big-w4 --offload disk --device-budget 40GB
  jgptq quantize ./model --calib calib.txt --out ./model-Q4_K_M.gguf --export gguf --mix q4_k_m
"""


def _quant_options(p: argparse.ArgumentParser, bits: int, group_size: int) -> None:
    g = p.add_argument_group("quantization")
    g.add_argument("--format", default="int", help="weight format: 'int' (integer grids, for gptq and "
                   "compressed-tensors) or a GGML format such as q4_k (for --export gguf) (default: int)")
    g.add_argument("--bits", type=int, default=bits, help=f"bits per weight, 2..8 (default: {bits})")
    g.add_argument("--group-size", type=int, default=group_size,
                   help=f"input columns per scale; -1 = one per output row (default: {group_size})")
    sym = g.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=True,
                     help="symmetric grids, zero point in the middle (default)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric grids, a zero point per group")
    g.add_argument("--act-order", nargs="?", const="group_aware", default="none", choices=ACT_ORDERS,
                   help="column order of the solve; the bare flag means group_aware, which every exporter "
                        "holds ('desc' with groups: gptq only) (default: none)")
    g.add_argument("--damp", type=float, default=0.01, help="relative Hessian damping (default: 0.01)")
    g.add_argument("--method", choices=("gptq", "rtn"), default="gptq",
                   help="gptq, or rtn: round-to-nearest on the same grids, a baseline; with a GGML format a plain "
                        "encode with importance, as llama-quantize with an imatrix (default: gptq)")
    g.add_argument("--mix", choices=MIXES, help="a llama.cpp mix for GGML formats (q4_k_m: q4_k with attn_v and "
                   "ffn_down raised to q6_k on llama.cpp's layers, ...); sets --format to its base")
    g.add_argument("--tensor-format", action="append", metavar="REGEX=FORMAT",
                   help="GGML format of the weights whose name relative to a layer (self_attn.v_proj, "
                        "mlp.experts.down_proj) matches REGEX; first match wins; repeatable")
    g.add_argument("--importance", choices=("imatrix", "hessian", "none"), default="imatrix",
                   help="importance of the GGML encoders: llama.cpp's imatrix statistic of the calibration tokens, "
                        "the Hessian diagonal, or none (default: imatrix)")
    g.add_argument("--block-fallback", default="error", metavar="FORMAT",
                   help="GGML weights whose rows are not whole blocks of their format: 'error', 'llama.cpp' "
                        "(llama.cpp's fallback types) or a format name (default: error)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    from jgptq import __version__

    parser = argparse.ArgumentParser(
        prog="jgptq", description="GPTQ for Mixture-of-Experts language models, with the numerics in JAX.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jgptq {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    q = sub.add_parser("quantize", help="quantize a local transformers model folder and export it",
                       description="Quantize a local transformers model folder (safetensors) with GPTQ, layer by "
                                   "layer, and export a checkpoint. Killed runs resume from the last finished layer.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("model_dir", metavar="MODEL_DIR", help="local transformers model folder")
    q.add_argument("--calib", required=True, metavar="FILE_OR_DIR",
                   help="calibration text: a UTF-8 file, or a folder of .txt files")
    q.add_argument("--out", required=True, help="output checkpoint folder (or .gguf file for --export gguf)")
    q.add_argument("--export", choices=EXPORTS, default="compressed-tensors",
                   help="checkpoint format (default: compressed-tensors)")
    _quant_options(q, bits=4, group_size=128)
    c = q.add_argument_group("calibration")
    c.add_argument("--calibration", choices=("routed", "all_experts"), default="routed",
                   help="experts' Hessians from their routed tokens, or from every token (default: routed)")
    c.add_argument("--min-tokens", type=int, default=1,
                   help="experts with fewer calibration tokens are rounded to nearest, with a warning (default: 1)")
    c.add_argument("--samples", type=int, default=128, help="calibration sequences (default: 128)")
    c.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (default: 512)")
    c.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default: 8)")
    c.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: MODEL_DIR)")
    r = q.add_argument_group("run")
    r.add_argument("--device", help="torch device each layer runs on (default: cuda if available, else cpu)")
    r.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="dtype the model is loaded in (default: auto, the checkpoint's)")
    r.add_argument("--hessian-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="operands of the Hessian sums, accumulated in float32 (default: float32)")
    r.add_argument("--exclude", action="append", metavar="REGEX",
                   help="leave modules matching this pattern (relative to a layer, e.g. 'self_attn') in floating "
                        "point; repeatable")
    r.add_argument("--offload", choices=("none", "cpu", "disk"), default="none",
                   help="where decoder layers wait while another is processed: none (where they are loaded), cpu "
                        "(host memory), disk (one file per layer: host memory holds one layer) (default: none)")
    r.add_argument("--offload-dir", metavar="DIR",
                   help="folder of the layer files of --offload disk (default: OUT.jgptq-work/offload)")
    r.add_argument("--device-budget", metavar="SIZE",
                   help="bytes the run may place on the device, e.g. 40GB: checked against each layer's estimated "
                        "need before any work (default: no check)")
    r.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    r.add_argument("--trust-remote-code", action="store_true",
                   help="allow the model folder's own Python code to run (off unless given)")
    r.add_argument("--overwrite", action="store_true", help="replace an existing output")
    r.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue a killed run from its last finished layer (default: on)")
    r.add_argument("--quiet", action="store_true", help="no progress bars or messages")

    d = sub.add_parser("demo", help="quantize a tiny random MoE model: GPTQ against round-to-nearest",
                       description="Build a tiny Qwen3-MoE model with random weights, calibrate it on text shipped "
                                   "with jgptq, quantize it with GPTQ and with round-to-nearest, compare both with "
                                   "the float model on held-out text, and export the GPTQ model.")
    d.add_argument("--out", help="output checkpoint folder (default: a new temporary folder)")
    d.add_argument("--export", choices=EXPORTS, default="compressed-tensors",
                   help="checkpoint format (default: compressed-tensors)")
    d.add_argument("--bits", type=int, default=4, help="bits per weight (default: 4)")
    d.add_argument("--group-size", type=int, default=32, help="input columns per scale (default: 32)")
    d.add_argument("--layers", type=int, default=4, help="decoder layers of the demo model (default: 4)")
    d.add_argument("--samples", type=int, default=64, help="calibration sequences of 128 bytes (default: 64)")
    d.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    d.add_argument("--overwrite", action="store_true", help="replace an existing output")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv=None) -> int:
    """Entry point of the ``jgptq`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "quantize":
            from interop.command import run_quantize

            return run_quantize(args)
        from interop.demo import run_demo

        return run_demo(args)
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
