"""Solve programs compiled ahead (jgptq_torch.pipeline.solve.warm_solves, the WarmUp hook): the programs compiled
on the worker threads are the ones the first layer's solve runs (the solve compiles none of them again, counted by
JAX's own compile events), the bytes are those of a run without warm-up, a failing warm-up only logs, and a program
asked for by two threads at once compiles once."""

import copy
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgptq
from jgptq import bucket
from jgptq.export import GGMLWeight
from jgptq.parallel import engine, programs
from jgptq_torch.pipeline import layerwise, solve
from tests.tiny_models import build, token_ids

CALIB = token_ids(4, 32, seed=1)
INT = dict(bits=3, group_size=16, batch_size=4, progress=False)
GGML = dict(format="q4_0", formats=((r"v_proj$", "q8_0"),), batch_size=4, progress=False)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Compiles:
    """Every XLA backend compile while it is open, as (thread name, program name), from JAX's monitoring events."""

    def __init__(self):
        self.seen: list = []

    def __call__(self, event, duration, **kw):
        if event == COMPILE_EVENT:
            self.seen.append((threading.current_thread().name, kw.get("fun_name", "")))

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def _drained_join(self):
    """Warming.join once every job has started (a solve on a host of few cores drops those that have not)."""
    while True:
        with self._lock:
            if not self.jobs:
                break
        time.sleep(0.01)
    return _JOIN(self)


_JOIN = solve.Warming.join


def _run(float_model, opts, monkeypatch, warm: str):
    monkeypatch.setenv(solve.ENV_WARM_UP, warm)
    monkeypatch.setattr(solve.Warming, "join", _drained_join)
    engine._compiled.clear()
    bucket._decoders.clear()
    jax.clear_caches()
    model = copy.deepcopy(float_model)
    return model, jgptq.quantize_moe(model, CALIB, **opts)


def _assert_same(a_model, a, b_model, b):
    sa, sb = a_model.state_dict(), b_model.state_dict()
    assert all(np.array_equal(sa[k].float().numpy(), sb[k].float().numpy()) for k in sa)
    assert set(a.weights) == set(b.weights)
    for k, rec in a.weights.items():
        other = b.weights[k]
        if isinstance(rec, GGMLWeight):
            assert np.array_equal(rec.payload, other.payload), k
        else:
            for f in ("codes", "scales", "zeros", "g_idx"):
                assert np.array_equal(getattr(rec, f), getattr(other, f)), (k, f)
    assert [(r.name, r.method, r.reason) for r in a.report.records] == \
        [(r.name, r.method, r.reason) for r in b.report.records]


@pytest.mark.slow     # about 40 s each on 2 cores
@pytest.mark.parametrize("opts", [INT, GGML], ids=["int", "ggml"])
def test_warmed_programs_are_the_ones_the_solve_runs_same_bytes(opts, monkeypatch):
    float_model = build("qwen3_moe", num_hidden_layers=1)
    ref_model, ref = _run(float_model, opts, monkeypatch, "0")
    phases: dict = {}
    solve_layer = solve.solve_layer

    def watch(*args, **kwargs):
        phases["warm"] = list(compiles.seen)
        compiles.seen.clear()
        out = solve_layer(*args, **kwargs)
        phases["solve"] = list(compiles.seen)
        return out

    monkeypatch.setattr(solve, "solve_layer", watch)
    with Compiles() as compiles:
        model, result = _run(float_model, opts, monkeypatch, "1")
    _assert_same(ref_model, ref, model, result)
    warmed = {name for thread, name in phases["warm"] if thread.startswith("jgptq-warm-solves")}
    assert warmed, "nothing was compiled ahead"
    if "format" in opts:
        assert any(name.startswith("jit(decode_") for name in warmed), warmed
    again = [name for thread, name in phases["solve"] if name in warmed]
    assert again == [], f"the solve compiled warmed programs again: {again}"


@pytest.mark.slow     # about 50 s on 2 cores
def test_a_failing_warm_up_is_logged_and_the_run_goes_on(monkeypatch, caplog):
    float_model = build("qwen3_moe", num_hidden_layers=1)
    ref_model, ref = _run(float_model, GGML, monkeypatch, "0")
    import jgptq.methods.gptq as gptq_method

    def broken(*args, **kwargs):
        raise RuntimeError("no room for a warm-up")

    monkeypatch.setattr(gptq_method, "plan_guarded", broken)
    with caplog.at_level(logging.WARNING, logger=solve.log.name):
        model, result = _run(float_model, GGML, monkeypatch, "1")
    _assert_same(ref_model, ref, model, result)
    failed = [r.getMessage() for r in caplog.records if "compiling a solve program ahead failed" in r.getMessage()]
    assert failed and all("no room for a warm-up" in m for m in failed)


def test_warm_jobs_follow_the_plan_formats_and_skip_other_methods():
    from jgptq.config import PipelineConfig
    from jgptq_torch import models
    from jgptq_torch.pipeline import run_setup

    model = build("qwen3_moe", num_hidden_layers=1)
    cfg = PipelineConfig.build(None, format="q4_0", formats=((r"v_proj$", "q8_0"),))
    prefix, layers = models.find_decoder_layers(model)
    targets, plan = run_setup.plan_layers(prefix, layers, cfg)
    jobs = solve.warm_jobs(targets[0], f"{prefix}.0", plan, cfg)
    assert {what.split()[-1] for what, _ in jobs} == {"q4_0", "q8_0"}
    rtn = {k: p._replace(method="rtn") for k, p in plan.matrices.items()}
    assert solve.warm_jobs(targets[0], f"{prefix}.0", plan._replace(matrices=rtn), cfg) == []


def test_a_later_layer_with_a_format_of_its_own_has_buckets_not_seen_before():
    from jgptq.config import PipelineConfig
    from jgptq_torch import models
    from jgptq_torch.pipeline import run_setup

    model = build("qwen3_moe", num_hidden_layers=3)
    cfg = PipelineConfig.build(None, mix="q4_k_m", block_fallback="llama.cpp")   # more bits for the last down
    prefix, layers = models.find_decoder_layers(model)
    targets, plan = run_setup.plan_layers(prefix, layers, cfg)
    first, second, third = (solve.solve_buckets(t, f"{prefix}.{i}", plan) for i, t in enumerate(targets))
    assert second == first                        # nothing new: no warm-up, no compile
    new = third - first
    assert new and {b[4].format for b in new} == {plan.matrices[f"{prefix}.2.mlp.experts.down_proj"].format}


def test_join_drops_the_compiles_not_started_and_waits_for_the_others():
    started, release = threading.Event(), threading.Event()
    ran = []

    def slow(devices=None):
        started.set()
        release.wait()
        ran.append("slow")

    warming = solve.Warming([("slow", slow), ("later", lambda devices=None: ran.append("later"))], workers=1)
    started.wait()
    threading.Timer(0.2, release.set).start()
    assert warming.join() == ["later"]
    assert ran == ["slow"]


def test_a_program_asked_for_by_two_threads_compiles_once():
    def f(w, h):
        return jnp.tanh(w @ h).sum(axis=-1)

    spec, n = programs.make_spec(f, (jax.ShapeDtypeStruct((3, 4, 8), jnp.float32),
                                     jax.ShapeDtypeStruct((8, 8), jnp.float32)), (0, None))
    mesh = programs.expert_mesh(jax.devices()[:1])
    got, start = [], threading.Barrier(3)

    def ask():
        start.wait()
        got.append(programs.compiled_program(spec, mesh, n, 1))

    with Compiles() as compiles:
        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == 3 and all(g is got[0] for g in got)
    assert len(compiles.seen) == 1, compiles.seen     # the one program, by one of the threads


@pytest.mark.slow     # about 50 s on 2 cores
def test_a_pass_in_chunks_of_experts_compiles_nothing_ahead(monkeypatch):
    """A layer whose routed experts go in chunks (memory planned full) starts no warm-up: no solve or group
    program on a worker thread; the bytes are those of the run without warm-up. A whole layer of the same model
    does warm up (the guard is the chunk, not the model)."""
    from jgptq_torch.pipeline import hooks
    from tests.tiny_models import chunk_budget

    float_model = build("qwen3_moe", num_hidden_layers=1)
    full = jgptq.quantize_moe(copy.deepcopy(float_model), CALIB, **INT)
    opts = dict(INT, offload="cpu", device_budget=chunk_budget(float_model, full, 3))
    ref_model, ref = _run(float_model, opts, monkeypatch, "0")
    started = []
    monkeypatch.setattr(hooks, "warm_solves", lambda *a, **k: started.append("solves"))
    monkeypatch.setattr(hooks.WarmUp, "_warm_groups", lambda self, run, step: started.append("groups"))
    with Compiles() as compiles:
        model, result = _run(float_model, opts, monkeypatch, "1")
    assert [p["experts_per_chunk"] for p in result.report.memory["expert_chunks"]] == [[3, 3, 2]]
    assert started == [] and not [t for t, _ in compiles.seen if t.startswith("jgptq-warm")]
    _assert_same(ref_model, ref, model, result)
    _run(float_model, INT, monkeypatch, "1")
    assert started == ["groups", "solves"]
