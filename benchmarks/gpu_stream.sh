#!/usr/bin/env bash
# The two streamed frontier shapes on one GPU, each in a fresh temporary folder (removed after): DeepSeek-V3 (3 dense
# + 2 MoE layers of all 256 experts, from FP8 with 128x128 block scales) and Qwen3-235B-A22B (6 MoE layers, from
# bf16), 64 x 2048 calibration tokens, int4 g128, with the allocators under which each ran through on an 80 GB card:
# JAX on its platform allocator for DeepSeek-V3 (JAX then gives back what a program freed, for torch's next layer),
# both frameworks on CUDA's stream-ordered allocator for Qwen3-235B (README "Streaming a model from disk").
#
#   benchmarks/gpu_stream.sh OUT_DIR [TAG] [extra stream_model options, e.g. --tiny for a CPU smoke run]
#
# Writes OUT_DIR/stream_model_{deepseek_v3,qwen3_235b}_TAG.json (TAG default: gpu) and .log, and prints each run's
# steady MoE layer and the whole model extrapolated. The runs, one after the other, need
# at most about 45 GB of disk at a time (DeepSeek-V3: a 28.5 GB checkpoint and 16.5 GB out) and took about 3.5 and
# 1.5 minutes on an H100 80GB.
# Run from the repository root; PYTHON (default python3) runs the benchmarks.
set -euo pipefail
out=${1:?usage: benchmarks/gpu_stream.sh OUT_DIR [TAG] [stream_model options]}
tag=${2:-gpu}
shift $(( $# > 1 ? 2 : 1 ))
py=${PYTHON:-python3}
mkdir -p "$out"

XLA_PYTHON_CLIENT_ALLOCATOR=platform "$py" -m benchmarks stream_model --shape deepseek_v3 --layers 5 "$@" \
  --out "$out/stream_model_deepseek_v3_$tag.json" 2>&1 | tee "$out/stream_model_deepseek_v3_$tag.log"
TF_GPU_ALLOCATOR=cuda_malloc_async PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync \
  "$py" -m benchmarks stream_model --shape qwen3_235b --layers 6 "$@" \
  --out "$out/stream_model_qwen3_235b_$tag.json" 2>&1 | tee "$out/stream_model_qwen3_235b_$tag.log"

"$py" - "$out" "$tag" <<'PY'
import json, sys

out, tag = sys.argv[1:]
for shape in ("deepseek_v3", "qwen3_235b"):
    r = json.load(open(f"{out}/stream_model_{shape}_{tag}.json"))
    w = r["whole_model"]
    print(f"{shape}: {r['layers']} layers in {r['quantize_total_s']:.1f} s, steady MoE layer "
          f"{w['moe_layer_s']:.1f} s; {w['model_layers']} layers extrapolated to {w['model_s'] / 60:.1f} min; "
          f"host RSS {r['peak_host_rss_bytes'] / 1e9:.1f} GB")
PY
