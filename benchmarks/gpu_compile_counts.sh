#!/usr/bin/env bash
# Where a cold jgptq run of the peers_quality model spends its compiles on a GPU: the int4 gptq row, each time in a
# fresh process with no compilation cache and JAX_LOG_COMPILES=1, under XLA's default flags and then under each
# XLA_FLAGS given after OUT_DIR (default: one run with --xla_gpu_autotune_level=0, which skips the timing of GEMM
# algorithms). The trained model is taken from OUT_DIR/models (trained there on the first call).
#
#   benchmarks/gpu_compile_counts.sh OUT_DIR ["XLA flags" ...]
#
# Writes OUT_DIR/compiles.txt: per variant the programs compiled per jitted function (count, seconds summed over
# threads), the routed-group shapes met, the row's KL and its quantize seconds by stage. Run from the repository
# root; PYTHON (default python3) runs the benchmark.
set -euo pipefail
out=${1:?usage: benchmarks/gpu_compile_counts.sh OUT_DIR ["XLA flags" ...]}
shift
[ $# -gt 0 ] || set -- "--xla_gpu_autotune_level=0"
py=${PYTHON:-python3}
mkdir -p "$out"
summary="$out/compiles.txt"
: > "$summary"
i=0
for flags in "" "$@"; do
  work="$out/variant$i"
  i=$((i + 1))
  XLA_FLAGS="$flags" JAX_LOG_COMPILES=1 "$py" -m benchmarks peers_quality --bits 4 --jgptq gptq --peers "" \
    --work "$work" --model-cache "$out/models" --out "$work/result.json" > "$work.log" 2>&1 || true
  log="$work/jgptq-gptq-int4.log"
  {
    echo "== XLA_FLAGS='$flags'"
    if [ ! -s "$work/jgptq-gptq-int4.json" ]; then echo "failed: $(tail -3 "$work.log")"; continue; fi
    grep -o 'Finished XLA compilation of jit([A-Za-z_0-9]*) in [0-9.e-]*' "$log" |
      awk '{n[$5]++; t[$5] += $7} END {for (k in n) printf "%s %d %.2f\n", k, n[k], t[k]}' | sort -k3 -nr || true
    echo "group shapes: $(grep -o 'float32\[[0-9]*,[0-9]*,[0-9]*\]' "$log" | sort -u | tr '\n' ' ' || true)"
    grep "^int4 jgptq" "$work.log" || true
    "$py" -c "import json, sys; r = json.load(open(sys.argv[1])); s = r['stage_s']
print('quantize_s', round(r['quantize_s'], 2), {k: round(v, 2) for k, v in s.items()})" \
      "$work/jgptq-gptq-int4.json" || echo "no result"
  } >> "$summary"
done
cat "$summary"
