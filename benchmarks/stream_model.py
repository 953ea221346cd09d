"""A model no machine holds, streamed from disk layer by layer: jgptq.quantize_folder on a written checkpoint.

The benchmark first writes a checkpoint folder of a real model's shape with random weights and N decoder
layers (``--layers``), in safetensors shards of ``--shard-gb`` GB with an index, then streams it through
:func:`jgptq.quantize_folder` (the Python path of ``jgptq quantize``: the skeleton on meta, each layer read from
the shards when its turn comes, the compressed-tensors output written as the layers finish).

Shapes (``--shape``):

- ``deepseek_v3``: DeepSeek-V3 / R1 (671B): hidden 7168, MLA (q_lora 1536, kv_lora 512, rope 64, nope 128,
  v 128, 128 heads), 256 routed experts of width 2048 + 1 shared, top-8, the first 3 layers dense (intermediate
  18432), 61 layers; linear weights FP8 (e4m3) with 128x128 block scales (``weight_scale_inv``), as released,
  dequantized on read to bf16.
- ``qwen3_235b``: Qwen3-235B-A22B: hidden 4096, 94 layers, 128 experts of width 1536, top-8, 64 query / 4
  key-value heads of 128, bf16.

``--experts N`` keeps N routed experts a layer instead of the shape's. A whole DeepSeek-V3 MoE layer is estimated
at 331 GB on the device (128 x 2048 tokens), over one H200: with ``--device-budget 120GB`` (or, on a GPU, without a budget: its free
memory) its 256 routed experts are calibrated and solved a chunk at a time
(:mod:`jgptq_torch.pipeline.expert_chunks`); the JSON's ``memory["expert_chunks"]`` gives the plan, and the
``calibrate`` stage includes one more forward of the layer per chunk after the first.
``--tiny`` shrinks either shape to a few kilobytes a layer (a smoke run on a CPU). Weights are drawn on the
GPU when there is one (FP8 codes drawn directly, with block scales near 0.02 / their spread), so writing is
bound by the disk.

Reported (JSON): seconds per layer by stage (``report.timings``: offload = waiting for the layer's read,
calibrate, solve, write, store, replay), peak host RSS (``ru_maxrss``), peak GPU memory (torch and JAX), bytes
read from the checkpoint and the most tensor bytes materialized at once, the written output's bytes, and the
whole model extrapolated from the measured run: its total (set-up, compiles and the output's last writes
included) plus every layer not measured at its kind's steady cost (dense and MoE apart: the mean of the kind's
layers after the first, whose solve compiles; never below the output writer's seconds per layer, since the writer
works beside the layers and would set the pace if it were slower), and the same with the median of those layers
(``model_median_s``: a one-off compile in one later layer is not multiplied by the unmeasured ones), and the expert
planner's messages during the run (``planner_log``: each chunked bucket's program, batch and chunks, seconds from
the start).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import shutil
import tempfile
import time

from benchmarks import common

DOC = __doc__.splitlines()[0]

SHAPES = {
    "deepseek_v3": dict(family="deepseek_v3", hidden=7168, layers=61, dense=3, dense_width=18432, experts=256,
                        width=2048, top_k=8, shared=1, heads=128, q_lora=1536, kv_lora=512, rope=64, nope=128,
                        v=128, vocab=129280, fp8=True, block=128, n_group=8, topk_group=4),
    "qwen3_235b": dict(family="qwen3_moe", hidden=4096, layers=94, dense=0, dense_width=12288, experts=128,
                       width=1536, top_k=8, heads=64, kv_heads=4, head_dim=128, vocab=151936, fp8=False),
}
TINY = {
    "deepseek_v3": dict(SHAPES["deepseek_v3"], hidden=64, layers=3, dense=1, dense_width=128, experts=8, width=32,
                        top_k=2, heads=4, q_lora=32, kv_lora=16, rope=8, nope=8, v=16, vocab=256, block=16,
                        n_group=2, topk_group=1),
    "qwen3_235b": dict(SHAPES["qwen3_235b"], hidden=64, layers=2, experts=8, width=32, top_k=2, heads=4,
                       kv_heads=2, head_dim=16, vocab=256, dense_width=128),
}


def model_config(s: dict, layers: int):
    """The transformers config of shape ``s`` with ``layers`` decoder layers."""
    import transformers

    if s["family"] == "deepseek_v3":
        return transformers.DeepseekV3Config(
            vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=layers, num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"], intermediate_size=s["dense_width"], moe_intermediate_size=s["width"],
            n_routed_experts=s["experts"], n_shared_experts=s["shared"], num_experts_per_tok=s["top_k"],
            n_group=s["n_group"], topk_group=s["topk_group"], first_k_dense_replace=s["dense"],
            q_lora_rank=s["q_lora"], kv_lora_rank=s["kv_lora"], qk_rope_head_dim=s["rope"],
            qk_nope_head_dim=s["nope"], v_head_dim=s["v"], max_position_embeddings=4096, tie_word_embeddings=False,
            dtype="bfloat16")
    return transformers.Qwen3MoeConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=layers, num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate_size=s["dense_width"],
        moe_intermediate_size=s["width"], num_experts=s["experts"], num_experts_per_tok=s["top_k"],
        norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16")


def checkpoint_tensors(cfg) -> dict:
    """Checkpoint name -> (shape, dtype) of every tensor a model of ``cfg`` saves (its names as released: experts
    per expert), from the model's skeleton on meta and transformers' own reverse conversion."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    state = revert_weight_conversion(model, model.state_dict())
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def _is_fp8(name: str, shape: tuple) -> bool:
    """Which tensors a DeepSeek-V3 release stores in FP8: the 2-D linear weights of the decoder layers but the
    router's."""
    return (".layers." in name and name.endswith(".weight") and len(shape) == 2 and not name.endswith("mlp.gate.weight")
            and "norm" not in name)


def _draw(name, shape, dtype, s, device, g):
    """Random tensors of one checkpoint name: {name: tensor} (FP8 weights with their ``weight_scale_inv``)."""
    import torch

    if "norm" in name:
        return {name: torch.ones(shape, dtype=dtype, device=device)}
    if name.endswith("e_score_correction_bias"):
        return {name: torch.zeros(shape, dtype=torch.float32, device=device)}
    if s["fp8"] and _is_fp8(name, shape):
        codes = torch.randn(shape, device=device, generator=g).to(torch.float8_e4m3fn)
        b = s["block"]
        blocks = (-(-shape[0] // b), -(-shape[1] // b))
        scale = 0.02 * (1 + 0.1 * torch.rand(blocks, device=device, generator=g))
        return {name: codes, name[: -len(".weight")] + ".weight_scale_inv": scale.float()}
    return {name: (0.02 * torch.randn(shape, device=device, generator=g)).to(dtype)}


def write_checkpoint(folder, s: dict, layers: int, shard_bytes: int, device: str) -> dict:
    """Writes the random checkpoint of shape ``s`` with ``layers`` decoder layers into ``folder`` (config.json,
    ``model-XXXXX-of-YYYYY.safetensors`` shards, the index). Returns {"bytes", "seconds", "files"}."""
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    cfg = model_config(s, layers)
    cfg.save_pretrained(folder)
    if s["fp8"]:
        raw = json.load(open(os.path.join(folder, "config.json")))
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [s["block"], s["block"]]}
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
    g = torch.Generator(device=device).manual_seed(0)
    pending, pending_bytes, shards, weight_map, total = {}, 0, [], {}, 0

    def flush():
        nonlocal pending, pending_bytes
        if pending:
            name = f"shard-{len(shards):05d}.tmp"
            save_file({k: v.to("cpu").contiguous() for k, v in pending.items()}, os.path.join(folder, name),
                      metadata={"format": "pt"})
            shards.append((name, list(pending)))
            pending, pending_bytes = {}, 0

    for name, (shape, dtype) in checkpoint_tensors(cfg).items():
        for key, t in _draw(name, shape, dtype, s, device, g).items():
            pending[key] = t
            pending_bytes += t.numel() * t.element_size()
            total += t.numel() * t.element_size()
        if pending_bytes >= shard_bytes:
            flush()
    flush()
    n = len(shards)
    for k, (tmp, keys) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(folder, tmp), os.path.join(folder, final))
        weight_map.update(dict.fromkeys(keys, final))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return {"bytes": total, "seconds": time.perf_counter() - t0, "files": n}


def extrapolate(timings: dict, s: dict, layers: int, total: float, writer_busy_s=None) -> dict:
    """Seconds of the whole model (``s["layers"]`` layers, ``s["dense"]`` of them dense) from the measured run:
    the measured total (set-up, compiles, the output's last writes included) plus each layer not measured at its
    kind's steady cost. A kind's steady cost is the mean of its measured layers after the first (compiling), or that
    first one alone, without the ``export`` stage (the wait for the writer at the end, counted once in the total);
    but never below the writer's seconds per measured layer, since the output is written beside the work and a
    writer slower than the layers would set the pace (``writer_busy_s`` over all measured layers: an upper bound,
    as it includes the tensors outside the layers).

    ``model_s`` takes the mean (a one-off compile in a later measured layer is spread over every unmeasured one:
    an upper bound); ``model_median_s`` takes the median of the kind's layers after the first and before the run's
    last measured layer (which has no replay and holds the end of the stores' work; it is one of them only when
    fewer than two remain): with three or more, one layer's one-off compile does not count for the rest."""
    def seconds(i):
        return sum(v for k, v in timings.get(i, {}).items() if k != "export")

    def mean_of(idx):
        warm = idx[1:] or idx
        return sum(seconds(i) for i in warm) / len(warm) if warm else None

    def median_of(idx):
        inner = [i for i in idx[1:] if i != layers - 1]
        warm = sorted(seconds(i) for i in (inner if len(inner) >= 2 else idx[1:] or idx))
        if not warm:
            return None
        mid = len(warm) // 2
        return warm[mid] if len(warm) % 2 else (warm[mid - 1] + warm[mid]) / 2

    writer = writer_busy_s / layers if writer_busy_s else 0.0
    dense = [i for i in range(layers) if i < s["dense"]]
    moe = [i for i in range(layers) if i >= s["dense"]]
    d, m = mean_of(dense), mean_of(moe)
    d_steady, m_steady = max(d or 0.0, writer), max(m or 0.0, writer)
    more_dense = max(s["dense"] - len(dense), 0)
    more_moe = max(s["layers"] - s["dense"] - len(moe), 0)
    full = total + more_dense * d_steady + more_moe * m_steady
    dm, mm = median_of(dense), median_of(moe)
    median = total + more_dense * max(dm or 0.0, writer) + more_moe * max(mm or 0.0, writer)
    return {"dense_layer_s": d, "moe_layer_s": m, "writer_per_layer_s": writer or None,
            "dense_layer_steady_s": d_steady if d is not None else None, "moe_layer_steady_s": m_steady,
            "dense_layer_median_s": dm, "moe_layer_median_s": mm,
            "measured_total_s": total, "model_layers": s["layers"], "model_dense_layers": s["dense"],
            "model_s": full, "model_h": full / 3600, "model_min": full / 60,
            "model_median_s": median, "model_median_min": median / 60}


@contextlib.contextmanager
def _planner_log(t0: float, most: int = 1000):
    """The expert planner's messages while the run goes (which programs ran at which batch, in how many chunks,
    when a bucket planned anew), as "SECONDS message" lines from ``t0``; the logger's level is put back after."""
    lines: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            if len(lines) < most:
                lines.append(f"{time.perf_counter() - t0:.1f} {record.getMessage()}")

    logger, handler = logging.getLogger("jgptq.parallel"), Keep(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv=None):
    p = common.parser("stream_model", DOC)
    p.add_argument("--shape", choices=sorted(SHAPES), default="deepseek_v3")
    p.add_argument("--tiny", action="store_true", help="a few kilobytes a layer: a smoke run on a CPU")
    p.add_argument("--layers", type=int, default=None, help="decoder layers written and streamed (default: "
                                                            "the dense ones + 2; --tiny: the tiny shape's)")
    p.add_argument("--experts", type=int, default=None,
                   help="routed experts per MoE layer instead of the shape's (a DeepSeek-V3 layer with all 256 is "
                        "estimated at over 300 GB on the device: under --device-budget, or a GPU's free memory, its experts "
                        "go in chunks; the JSON's memory record gives the plan)")
    p.add_argument("--shard-gb", type=float, default=4.0, help="GB per checkpoint shard (default: 4)")
    p.add_argument("--sequences", type=int, default=None, help="calibration sequences (default: 64; tiny: 8)")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (default: 2048; tiny: 32)")
    p.add_argument("--batch", type=int, default=None, help="sequences per forward (default: 8; tiny: 4)")
    p.add_argument("--device-budget", default=None, help="bytes the run may place on the device, e.g. 120GB (a "
                                                          "MoE layer over it goes in chunks of routed experts)")
    p.add_argument("--dir", default=None, help="where the checkpoint and output are written (default: a temporary"
                                               " folder, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the written checkpoint and output")
    args = p.parse_args(argv)
    args.tiny = args.tiny or args.small
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jgptq
    import torch

    s = dict((TINY if args.tiny else SHAPES)[args.shape])
    if args.experts:
        s.update(experts=args.experts, top_k=min(s["top_k"], args.experts))
    layers = args.layers or (s["layers"] if args.tiny else s["dense"] + 2)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sequences = args.sequences or (8 if args.tiny else 64)
    length = args.length or (32 if args.tiny else 2048)
    batch = args.batch or (4 if args.tiny else 8)
    group = 16 if args.tiny else 128
    root = args.dir or tempfile.mkdtemp(prefix="jgptq-stream-")
    src, out_dir = os.path.join(root, "model"), os.path.join(root, "out")
    out = {"benchmark": "stream_model", "description": __doc__, "shape_name": args.shape, "tiny": args.tiny,
           "shape": s, "layers": layers, "device": device, "calibration": [sequences, length]}
    try:
        shard = 100_000 if args.tiny else int(args.shard_gb * 1e9)    # tiny: several shards all the same
        out["checkpoint"] = write_checkpoint(src, s, layers, shard, device)
        print({"checkpoint": out["checkpoint"]}, flush=True)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        calib = torch.randint(0, s["vocab"], (sequences, length), generator=torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        with _planner_log(t0) as planner_log:
            result = jgptq.quantize_folder(src, calib, out_dir, bits=4, group_size=group, sym=True,
                                           scale_dtype="bfloat16", hessian_dtype="bfloat16", batch_size=batch,
                                           device=device, device_budget=args.device_budget, progress=True)
        total = time.perf_counter() - t0
        out["planner_log"] = planner_log
        report = result.report
        timings = {i: dict(report.timings.get(i, {})) for i in range(layers)}
        out.update({
            "quantize_total_s": total, "stage_s": report.stage_totals(),
            "per_layer_s": {str(i): t for i, t in timings.items()},
            "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "memory": report.memory,
            "bytes_read": report.memory.get("streamed", {}).get("bytes_read"),
            "output_bytes": sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(out_dir) for f in fs),
            "whole_model": extrapolate(timings, s, layers, total, report.memory.get("writer_busy_s")),
        })
        if cuda:
            import jax

            out["peak_gpu_torch_bytes"] = int(torch.cuda.max_memory_allocated())
            stats = jax.devices()[0].memory_stats() or {}
            out["peak_gpu_jax_bytes"] = int(stats.get("peak_bytes_in_use", 0))
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if "memory" in out:
        out["expert_chunks"] = out["memory"].get("expert_chunks", [])
    print({k: v for k, v in out.items() if k not in ("description", "shape", "per_layer_s", "memory")}, flush=True)
    common.write(args.out, out)
    return 0
