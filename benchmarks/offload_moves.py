"""Layer moves between the GPU and host memory: pinned staging buffers against plain ``module.to`` copies.

Builds moe_model's Qwen3-30B-A3B shape with ``--layers`` decoder layers (default 6, 1.25 GB each in bf16) on the
GPU, then for each way of moving (``module.to``, the anchor; :class:`jgptq_torch.pipeline.moves.Staging`) and each number of
worker threads placing the layers: the time to put every layer in host memory before a run (eager placement, as
with a ``device_budget``), then one layer to the device and back, checking the bytes came back unchanged. The JSON
gives the seconds and the ratios anchor / staged. Needs a CUDA device.
"""

from __future__ import annotations

import os
import time

from benchmarks import common
from benchmarks.moe_model import FULL, build_model

DOC = __doc__.splitlines()[0]


def main(argv=None):
    p = common.parser("offload_moves", DOC)
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default 6)")
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    from jgptq_torch.pipeline import offload
    from jgptq.config import PipelineConfig

    if not torch.cuda.is_available():
        raise SystemExit("offload_moves needs a CUDA device")
    layers = 2 if args.small else args.layers
    out = {"benchmark": "offload_moves", "description": __doc__, "layers": layers, "runs": []}
    saved = offload.PREPARE_WORKERS, offload.STAGED_MOVES
    try:
        for staged, workers in ((False, 1), (False, 8), (True, 1), (True, 4)):
            model = build_model(FULL, layers, "cuda")
            torch.cuda.synchronize()
            offload.PREPARE_WORKERS, offload.STAGED_MOVES = workers, staged
            place = offload.Placement(model, model.model.layers, PipelineConfig(offload="cpu", device_budget="1PB"),
                                      torch.device("cuda"))
            t0 = time.perf_counter()
            place.prepare()
            prepare_s = time.perf_counter() - t0
            ref = model.model.layers[0].mlp.experts.down_proj.detach().clone()
            t0 = time.perf_counter()
            place._arrive(0)
            torch.cuda.synchronize()
            in_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            place._leave(0)
            out_s = time.perf_counter() - t0
            same = bool(torch.equal(ref, model.model.layers[0].mlp.experts.down_proj))
            row = {"staged": staged, "workers": workers, "prepare_s": prepare_s, "layer_in_s": in_s,
                   "layer_out_s": out_s, "bytes_unchanged": same}
            print(row, flush=True)
            out["runs"].append(row)
            del model, place
            torch.cuda.empty_cache()
    finally:
        offload.PREPARE_WORKERS, offload.STAGED_MOVES = saved
    plain = next(r for r in out["runs"] if not r["staged"] and r["workers"] == 1)
    staged1 = next(r for r in out["runs"] if r["staged"] and r["workers"] == 1)
    out["ratio_plain_over_staged"] = {k: plain[k] / staged1[k] for k in ("prepare_s", "layer_in_s", "layer_out_s")}
    common.write(args.out, out)
    return 0
