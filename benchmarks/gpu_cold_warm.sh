#!/usr/bin/env bash
# A user's first run against a warm one: the Qwen3-30B-A3B-shaped moe_model benchmark (48 layers), int4 and GGML
# q4_k with its GGUF written during the run, each first with an empty compilation cache (cold: XLA cache and
# program store, JGPTQ_COMPILATION_CACHE, in a fresh folder of its own), then again on that folder (warm).
#
#   benchmarks/gpu_cold_warm.sh OUT_DIR [extra moe_model options, e.g. --small for a smoke run]
#
# Writes OUT_DIR/moe_model_{int4,q4_k}_{cold,warm}.json (the benchmark's --out) and .log, and prints
# cold / warm per format with layer 0's and the other layers' stages. Run from the repository root;
# PYTHON (default python3) runs the benchmarks.
set -euo pipefail
out=${1:?usage: benchmarks/gpu_cold_warm.sh OUT_DIR [moe_model options]}
shift
py=${PYTHON:-python3}
mkdir -p "$out"
caches=$(mktemp -d "${TMPDIR:-/tmp}/jgptq-cold-warm.XXXXXX")
trap 'rm -rf "$caches"' EXIT

run() {   # run NAME [options]: a cold run on a fresh cache folder, then a warm run on the same folder
  local name=$1
  shift
  local cache="$caches/$name"
  mkdir -p "$cache"
  for phase in cold warm; do
    echo "== $name $phase (JGPTQ_COMPILATION_CACHE=$cache)"
    JGPTQ_COMPILATION_CACHE="$cache" "$py" -m benchmarks moe_model "$@" \
      --out "$out/moe_model_${name}_${phase}.json" 2>&1 | tee "$out/moe_model_${name}_${phase}.log"
  done
}

run int4 "$@"
run q4_k --format q4_k --export "$@"

"$py" - "$out" <<'EOF'
import json, sys

out = sys.argv[1]
for name in ("int4", "q4_k"):
    r = {p: json.load(open(f"{out}/moe_model_{name}_{p}.json")) for p in ("cold", "warm")}
    cold, warm = (r[p]["quantize_total_s"] for p in ("cold", "warm"))
    print(f"{name}: cold {cold:.1f} s, warm {warm:.1f} s, cold/warm {cold / warm:.2f}x")
    for p in ("cold", "warm"):
        layers = r[p]["per_layer_s"]
        rest = {}
        for i, stages in layers.items():
            if i != "0":
                for k, v in stages.items():
                    rest[k] = rest.get(k, 0.0) + v
        print(f"  {p}: layer 0 " + ", ".join(f"{k} {v:.1f}" for k, v in layers["0"].items())
              + " | layers 1+ " + ", ".join(f"{k} {v:.1f}" for k, v in rest.items()))
EOF
