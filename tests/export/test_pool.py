"""Records packed on a thread pool ahead of the writer: results in order, errors where a plain loop meets them,
at most ``lookahead`` jobs held, and checkpoint folders byte-identical whatever the number of workers."""

import threading

import numpy as np
import pytest

from jgptq.export import QuantizedWeight, export_compressed_tensors, export_gptq_v1
from jgptq.export import pool
from jgptq.export.pool import check_workers, default_workers, ordered_results

MODEL_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "vocab_size": 32}


class Boom(Exception):
    pass


def export_threads():
    return [t for t in threading.enumerate() if t.name.startswith("jgptq-export")]


def run_jobs(n, workers, lookahead=None, fail_job=None, fail_input=None):
    """Consumes ``n`` jobs (job k returns k, after a delay that makes later jobs finish first); returns (results,
    error, the most jobs ever taken and not yet handed on)."""
    done = threading.Event()
    state = {"taken": 0, "consumed": 0, "most": 0}

    def job(k):
        if k < 3:
            done.wait(0.05)            # the first jobs finish last: results must still come in order
        if k == fail_job:
            raise Boom(f"job {k}")
        return k

    def jobs():
        for k in range(n):
            if k == fail_input:
                raise Boom(f"input {k}")
            state["taken"] += 1
            state["most"] = max(state["most"], state["taken"] - state["consumed"])
            yield lambda k=k: job(k)

    got, error = [], None
    try:
        for value in ordered_results(jobs(), workers, lookahead):
            state["consumed"] += 1
            got.append(value)
    except Boom as exc:
        error = str(exc)
    return got, error, state["most"]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_results_in_order_and_lookahead_bounded(workers):
    got, error, most = run_jobs(40, workers, lookahead=None if workers == 1 else workers + 1)
    assert got == list(range(40)) and error is None
    assert most <= (1 if workers == 1 else workers + 1)
    assert export_threads() == []            # the pool is shut down once the results are handed on


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("fail_job, fail_input, want", [
    (5, None, "job 5"),          # a worker's error, after the results before it
    (None, 7, "input 7"),        # the input's error, in its place although jobs were taken ahead of it
    (5, 7, "job 5"),             # the first error met wins, as in a plain loop
    (9, 7, "input 7"),
])
def test_errors_surface_where_a_loop_meets_them(workers, fail_job, fail_input, want):
    got, error, _ = run_jobs(20, workers, fail_job=fail_job, fail_input=fail_input)
    first = min(k for k in (fail_job, fail_input) if k is not None)
    assert error == want and got == list(range(first))
    assert export_threads() == []


def test_abandoned_consumer_stops_the_pool():
    results = ordered_results((lambda k=k: k for k in range(100)), workers=3)
    assert next(results) == 0
    results.close()
    assert export_threads() == []


def test_worker_counts():
    assert 1 <= default_workers() <= pool.MAX_DEFAULT_WORKERS
    assert check_workers(None) == default_workers() and check_workers(5) == 5
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="positive integer"):
            check_workers(bad)
    with pytest.raises(ValueError, match="at least workers"):
        list(ordered_results([], workers=4, lookahead=3))


def records(n, bits=4, group=16, rows=24, cols=64, sym=True, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for k in range(n):
        codes = rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8)
        scales = rng.uniform(0.01, 1.0, (rows, cols // group)).astype(np.float16).astype(np.float32)
        zeros = (np.full_like(scales, 1 << (bits - 1), np.uint8) if sym
                 else rng.integers(1, 1 << bits, scales.shape, dtype=np.uint8))
        out[f"model.layers.{k // 3}.mlp.experts.{k % 3}.up_proj"] = QuantizedWeight(
            codes, scales, zeros, np.arange(cols, dtype=np.int32) // group, bits=bits, group_size=group, sym=sym,
            act_order="static", scale_dtype="float16")
    return out


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("export", [export_compressed_tensors, export_gptq_v1])
@pytest.mark.parametrize("bits, sym", [(4, True), (3, False), (8, False)])
def test_folders_are_byte_identical_for_any_worker_count(tmp_path, export, bits, sym):
    quantized = records(23, bits=bits, sym=sym)
    tensors = {"model.norm.weight": np.linspace(0, 1, 64, dtype=np.float32)}
    folders = []
    for workers in (1, 2, 5):
        out = tmp_path / f"w{workers}"
        export(out, iter(quantized.items()), tensors=tensors, model_config=MODEL_CONFIG, max_shard_bytes=3000,
               workers=workers)
        folders.append(folder_bytes(out))
    assert sum(n.endswith(".safetensors") for n in folders[0]) > 3
    assert folders[1] == folders[0] and folders[2] == folders[0]
    assert export_threads() == []


@pytest.mark.parametrize("workers", [1, 4])
def test_a_bad_record_among_many_raises_the_loop_error_and_writes_nothing(tmp_path, workers):
    quantized = list(records(12).items())
    name, rec = quantized[6]
    bad = QuantizedWeight(rec.codes, rec.scales * np.float32(1 + 2 ** -20), rec.zeros, rec.g_idx, bits=4,
                          group_size=16, sym=True)                       # float32 scales, not float16 values
    other = records(1, bits=8)                                           # another scheme, after the bad record
    entries = quantized[:6] + [(name, bad)] + quantized[7:9] + list(other.items())
    with pytest.raises(ValueError, match=f"{name}: scales are not float16 values"):
        export_gptq_v1(tmp_path / "m", iter(entries), model_config=MODEL_CONFIG, workers=workers)
    with pytest.raises(ValueError, match="differs from"):                # a check of the input, in its place
        export_compressed_tensors(tmp_path / "m", iter(quantized[:8] + list(other.items())),
                                  model_config=MODEL_CONFIG, workers=workers, ignore=[])
    assert list(tmp_path.iterdir()) == [] and export_threads() == []
