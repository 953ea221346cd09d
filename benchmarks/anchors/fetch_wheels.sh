#!/usr/bin/env bash
# Recreates the wheel folder that the peer-library benchmarks (peers_solver, peers_oneshot, peers_quality) need on a
# GPU machine without network: Python 3.12, x86-64, with torch, transformers, accelerate, triton, jax, numpy, pandas,
# pyarrow, safetensors, tqdm, pyyaml, requests, huggingface-hub, threadpoolctl, nvidia-ml-py, py-cpuinfo, psutil,
# xxhash, fsspec, httpx, pillow already installed.
# Only what is missing there is fetched, each pinned (typing-extensions too: pydantic-core needs >=4.16);
# nothing here changes torch.
#
#   PY312=/path/to/python3.12 bash benchmarks/anchors/fetch_wheels.sh [TARGET]   (default TARGET: .whl)
#
# On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#
# GPTQModel publishes only a source distribution; `pip wheel` turns it into a pure-Python wheel holding the CUDA
# sources of its fused GPTQ block kernel (gptqmodel_ext/gptq_block/*.cu, *.cpp), which GPTQModel's own loader
# compiles with nvcc and ninja at first use on the GPU machine.
set -euo pipefail
target="${1:-.whl}"
mkdir -p "$target"
py=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps -d "$target")
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

# GPTQModel 7.7.0 from its sdist, and the modules its package import needs beyond the machine's own
python3 -m pip wheel --no-deps gptqmodel==7.7.0 -w "$target"
# pypcre (a PCRE2 binding GPTQModel's config and logging import) has no binary wheel: built here with a Python
# 3.12 interpreter (PY312, default python3.12); the extension links the system libpcre2-8.so.0
"${PY312:-python3.12}" -m pip wheel --no-deps pypcre==0.6.4 -w "$target"
# (pure Python, published as sources only for some of these: built into wheels)
python3 -m pip wheel --no-deps logbar==0.4.15 device-smi==0.5.7 tokenicer==0.0.14 defuser==0.0.28 -w "$target"

# llm-compressor 0.14.0.1, the compressed-tensors it pins, and what their imports need (datasets for oneshot)
python3 -m pip download "${py[@]}" llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 \
    pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 typing-extensions==4.16.0
# AutoRound for llm-compressor's AutoRoundModifier: llm-compressor 0.14.0.1 asks auto-round>=0.14.1,<=0.15.1; its own
# needs (accelerate, datasets, numpy, py-cpuinfo, torch, tqdm, transformers, pydantic) are all there or above
python3 -m pip download "${py[@]}" auto-round==0.15.1
python3 -m pip download "${py[@]}" "${plat[@]}" pydantic-core==2.50.5

# jgptq's own dependency missing there
python3 -m pip download "${py[@]}" gguf==0.19.0

ls -l "$target"
du -sh "$target"
