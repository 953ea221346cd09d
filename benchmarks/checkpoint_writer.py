"""The streamed run's output writer on one MoE decoder layer's records: the previous code path against the new one.

A streamed run (:func:`jgptq.quantize_folder`) writes each finished layer's records through
:class:`jgptq_torch.export.folder_sink.CheckpointSink`, a writer thread running
:func:`jgptq.export.export_compressed_tensors`. This benchmark builds the records of one Qwen3-235B-A22B decoder
layer (attention q/k/v/o and ``--experts`` of the 128 experts' gate/up 1536x4096 and down 4096x1536; int4, groups
of 128, symmetric, bfloat16 scales: the records the pipeline hands the sink, each expert a view of its stack) and
writes them, in one process, as

- ``previous``: the packer as it was before the whole-byte path (codes shifted into uint32 words one at a time,
  after a uint8 copy and a min/max check), records packed one at a time in the writer thread;
- ``new_1``: today's packer, one at a time in the writer thread (``workers=1``);
- ``new_pool``: today's packer on ``--workers`` threads ahead of the writer (default: the exporter's default, at
  least 2).

Each is timed end to end (packing, scale conversion, safetensors serialization, the file written under the
system's temporary folder), median of ``--repeat`` runs, and every folder is checked byte-identical with the
previous path's. ``breakdown`` times the parts one by one on one thread (best of two passes: codes packed by
either packer, scales converted to bfloat16 and checked, every record's tensors, the safetensors file written);
``per_qwen_layer_s`` scales each time to the whole layer (128 experts) by code bytes when fewer experts were
built.

The GIL: a pure-Python counter on the main thread runs beside each writer (a thread, as in the pipeline, where
the main thread launches the device work) and beside the same writer in a forked child process (no GIL shared,
the same cores); ``main_thread_rate`` is the counter's speed beside the writer thread over its speed alone, and
``gil_rate`` its speed beside the thread over its speed beside the process: the share of the main thread's pace
that the writer's GIL holding leaves (1.0 or more: no cost of the GIL seen beside the cores' own contention; on
a host with fewer free cores than threads, ``main_thread_rate`` mostly measures that contention).

    python -m benchmarks checkpoint_writer [--experts 16] [--workers N] [--repeat 3] [--small]
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import common

DOC = __doc__.split("\n\n")[0]
HIDDEN, WIDTH, EXPERTS, GROUP = 4096, 1536, 128, 128
ATTENTION = {"q_proj": (8192, HIDDEN), "k_proj": (512, HIDDEN), "v_proj": (512, HIDDEN), "o_proj": (HIDDEN, 8192)}
EXPERT = {"gate_proj": (WIDTH, HIDDEN), "up_proj": (WIDTH, HIDDEN), "down_proj": (HIDDEN, WIDTH)}
MODEL_CONFIG = {"model_type": "qwen3_moe", "hidden_size": HIDDEN}


def layer_records(experts: int, scale: int = 1, seed: int = 0) -> dict:
    """Checkpoint key -> QuantizedWeight of one decoder layer (shapes divided by ``scale`` for a smoke run)."""
    import ml_dtypes

    from jgptq.export import QuantizedWeight

    rng = np.random.default_rng(seed)

    def stack(count, rows, cols):
        rows, cols = rows // scale, cols // scale
        groups = cols // GROUP
        codes = rng.integers(0, 16, (count, rows, cols), dtype=np.uint8)
        scales = rng.uniform(1e-3, 5e-2, (count, rows, groups)).astype(ml_dtypes.bfloat16).astype(np.float32)
        zeros = np.full((count, rows, groups), 8, np.uint8)
        g_idx = np.broadcast_to(np.arange(cols, dtype=np.int32) // GROUP, (count, cols))
        return QuantizedWeight(codes, scales, zeros, g_idx, bits=4, group_size=GROUP, sym=True, act_order="static",
                               scale_dtype="bfloat16")

    prefix = "model.layers.0"
    records = {f"{prefix}.self_attn.{p}": stack(1, *shape).take(0) for p, shape in ATTENTION.items()}
    stacks = {p: stack(experts, *shape) for p, shape in EXPERT.items()}
    for e in range(experts):
        for p, s in stacks.items():
            records[f"{prefix}.mlp.experts.{e}.{p}"] = s.take(e)
    return records


def full_layer_code_bytes() -> int:
    attention = sum(r * c for r, c in ATTENTION.values())
    return attention + EXPERTS * sum(r * c for r, c in EXPERT.values())


# -- the previous packer (before the whole-byte path), kept here as the baseline -----------------------------------
def previous_pack_int32(values, bits, axis=-1):
    """pack_int32 as it was for widths dividing 32: a uint8 copy, a min/max check, uint32 words built by shifting
    their values in one at a time, 2**26-bit steps."""
    values = np.asarray(values)
    if values.size and (values.min() < 0 or values.max() >= (1 << bits)):
        raise ValueError("values out of range")
    moved = np.moveaxis(values, axis, -1)
    lead, n = moved.shape[:-1], moved.shape[-1]
    lines = moved.reshape(-1, n).astype(np.uint8)
    per = 32 // bits
    words = -(-n * bits // 32)
    out = np.empty((lines.shape[0], words), np.int32)
    step = max(1, (1 << 26) // max(1, 8 * n * bits))
    for r0 in range(0, lines.shape[0], step):
        chunk = lines[r0:r0 + step]
        if n != words * per:
            chunk = np.pad(chunk, ((0, 0), (0, words * per - n)))
        v = chunk.reshape(chunk.shape[0], words, per)
        word = v[:, :, per - 1].astype(np.uint32)
        for k in range(per - 2, -1, -1):
            word <<= np.uint32(bits)
            word |= v[:, :, k]
        out[r0:r0 + step] = word.view(np.int32)
    return np.moveaxis(out.reshape(lead + (words,)), -1, axis)


@contextlib.contextmanager
def previous_packer():
    from jgptq.export import packing

    current = packing.pack_int32
    packing.pack_int32 = previous_pack_int32
    try:
        yield
    finally:
        packing.pack_int32 = current


# -- timing ---------------------------------------------------------------------------------------------------------
def export_once(records: dict, out: Path, workers: int) -> float:
    from jgptq.export import export_compressed_tensors

    t0 = time.perf_counter()
    export_compressed_tensors(out, iter(records.items()), model_config=MODEL_CONFIG, ignore=[], workers=workers)
    return time.perf_counter() - t0


def folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def counter(stop) -> float:
    """Counts in pure Python until ``stop()``; returns counts per second."""
    n, t0 = 0, time.perf_counter()
    while not stop():
        for _ in range(2000):
            n += 1
    return n / (time.perf_counter() - t0)


def rate_alone(seconds: float) -> float:
    end = time.perf_counter() + seconds
    return counter(lambda: time.perf_counter() > end)


def rate_beside_thread(work) -> float:
    th = threading.Thread(target=work)
    th.start()
    rate = counter(lambda: not th.is_alive())
    th.join()
    return rate


def rate_beside_process(work) -> float:
    pid = os.fork()
    if pid == 0:                      # the child: the same work, then out without running the parent's exit code
        code = 0
        try:
            work()
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    done = []
    rate = counter(lambda: done or (os.waitpid(pid, os.WNOHANG)[0] == pid and not done.append(1)))
    return rate


def breakdown(records: dict, scratch: Path, passes: int = 2) -> dict:
    """Seconds of each part of the writer's work over every record, on one thread (the best of ``passes``)."""
    from safetensors.numpy import save_file

    from jgptq.export import packing
    from jgptq.export.compressed_tensors import compressed_tensors
    from jgptq.export.records import storage_dtype

    bf16 = storage_dtype("bfloat16")
    recs = list(records.values())
    out = {}

    def timed(label, fn):
        t0 = time.perf_counter()
        result = fn()
        out[label] = min(out.get(label, float("inf")), time.perf_counter() - t0)
        return result

    for _ in range(passes):
        timed("g_idx_check_s", lambda: [r.has_plain_g_idx() for r in recs])
        timed("scales_to_bf16_s", lambda: [r.scales.astype(bf16) for r in recs])
        timed("scales_check_s", lambda: [np.all(r.scales.astype(bf16).astype(np.float32) == r.scales)
                                         for r in recs])
        timed("codes_pack_previous_s", lambda: [previous_pack_int32(r.codes, 4, axis=1) for r in recs])
        timed("codes_pack_new_s", lambda: [packing.pack_int32(r.codes, 4, axis=1) for r in recs])
        tensors = {}
        timed("all_tensors_new_s", lambda: [tensors.update(compressed_tensors(k, r, "bfloat16"))
                                            for k, r in records.items()])
        timed("safetensors_write_s", lambda: save_file(tensors, str(scratch / "one.safetensors"),
                                                       metadata={"format": "pt"}))
        out["written_bytes"] = os.path.getsize(scratch / "one.safetensors")
        os.remove(scratch / "one.safetensors")
    return out


def run_variant(name, records, scratch, workers, repeat, reference, use_previous) -> dict:
    times, digest = [], None
    for k in range(repeat):
        out = scratch / f"{name}-{k}"
        with previous_packer() if use_previous else contextlib.nullcontext():
            times.append(export_once(records, out, workers))
        if k == 0:
            digest = folder_digest(out)
        shutil.rmtree(out)
    res = {"workers": workers, "median_s": statistics.median(times), "runs_s": times, "sha256": digest}
    if reference is not None:
        res["identical_to_previous"] = digest == reference
    out = scratch / f"{name}-gil"

    def work():
        with previous_packer() if use_previous else contextlib.nullcontext():
            export_once(records, out, workers)
        shutil.rmtree(out, ignore_errors=True)

    alone = rate_alone(1.0)
    beside_thread = rate_beside_thread(work)
    beside_process = rate_beside_process(work)
    res["main_thread_rate"] = beside_thread / alone
    res["gil_rate"] = beside_thread / beside_process
    return res


def main(argv=None) -> int:
    from jgptq.export.pool import default_workers

    p = common.parser("checkpoint_writer", DOC)
    p.add_argument("--experts", type=int, default=16, help=f"experts built of the layer's {EXPERTS} (default 16)")
    p.add_argument("--workers", type=int, default=max(2, default_workers()), help="threads of the new_pool run")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each variant (median)")
    args = p.parse_args(argv)
    scale = 4 if args.small else 1
    experts = 2 if args.small else args.experts
    start = time.perf_counter()
    records = layer_records(experts, scale)
    code_bytes = sum(r.codes.nbytes for r in records.values())
    factor = 1.0 if args.small else full_layer_code_bytes() / code_bytes
    result = {"benchmark": "checkpoint_writer", "description": __doc__, "small": bool(args.small),
              "experts_built": experts, "records": len(records), "code_bytes": code_bytes,
              "scaled_to_qwen_layer_by": factor, "default_workers": default_workers(), "repeat": args.repeat,
              "setup_s": time.perf_counter() - start}
    scratch = Path(tempfile.mkdtemp(prefix="jgptq-writer-bench-"))
    try:
        result["breakdown"] = breakdown(records, scratch)
        variants = {}
        variants["previous"] = run_variant("previous", records, scratch, 1, args.repeat, None, True)
        ref = variants["previous"]["sha256"]
        variants["new_1"] = run_variant("new_1", records, scratch, 1, args.repeat, ref, False)
        variants["new_pool"] = run_variant("new_pool", records, scratch, args.workers, args.repeat, ref, False)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["variants"] = variants
    result["per_qwen_layer_s"] = {k: v["median_s"] * factor for k, v in variants.items()}
    result["breakdown_per_qwen_layer_s"] = {k: v * factor for k, v in result["breakdown"].items()
                                            if k.endswith("_s")}
    result["speedup_new_1_vs_previous"] = variants["previous"]["median_s"] / variants["new_1"]["median_s"]
    result["speedup_new_pool_vs_previous"] = variants["previous"]["median_s"] / variants["new_pool"]["median_s"]
    result["elapsed_s"] = time.perf_counter() - start
    for k, v in variants.items():
        print(f"{k:9s} workers {v['workers']}: {v['median_s']:.3f} s ({v['median_s'] * factor:.2f} s a Qwen layer), "
              f"main thread at {v['main_thread_rate']:.2f}, GIL leaves {v['gil_rate']:.2f}")
    common.write(args.out, result)
    return 0 if all(v.get("identical_to_previous", True) for v in variants.values()) else 1
