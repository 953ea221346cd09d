"""The routed experts' group programs compiled ahead (jgptq_torch.pipeline.warm_groups, the WarmUp hook): every
accelerator layout a forward can take is in the enumerated set, a warmed run's calibration compiles no group
program of its own (JAX's compile events), and its statistics and bytes are those of a run without warm-up."""

import copy
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgptq
from jgptq import statistics as st
from jgptq_torch.pipeline import hooks, routed_groups, solve, warm_groups
from tests.test_warm_up import COMPILE_EVENT
from tests.tiny_models import build, token_ids

CALIB = token_ids(4, 32, seed=3)


@pytest.mark.parametrize("bounded", [True, False], ids=["top_k", "no_top_k"])
def test_every_accelerator_layout_is_enumerated(bounded):
    rng = np.random.default_rng(7)
    for _ in range(400):
        experts = int(rng.choice([4, 8, 60, 128, 160, 256]))
        tokens = int(rng.choice([7, 64, 300, 2048, 8192, 20000]))
        top_k = int(rng.integers(1, min(8, experts) + 1))
        cols = int(rng.choice([64, 1536, 2880, 4096, 7168]))
        bytes_per_row = cols * int(rng.choice([2, 4]))
        share = rng.dirichlet(np.full(experts, float(rng.choice([0.05, 0.5, 5.0]))))
        counts = np.minimum(rng.multinomial(tokens * top_k, share), tokens)   # a token meets an expert once
        lo = int(rng.integers(0, experts))
        hi = experts if rng.random() < 0.5 else int(rng.integers(lo + 1, experts + 1))
        kept = [int(n) if lo <= e < hi else 0 for e, n in enumerate(counts)]
        allowed = set(routed_groups.layout_shapes(experts, hi - lo, bytes_per_row, tokens,
                                                  tokens * top_k if bounded else None))
        met = {(len(slots), p) for p, slots in routed_groups.group_layout(kept, bytes_per_row, True, hi - lo)}
        assert met <= allowed, (experts, tokens, top_k, cols, (lo, hi), sorted(met - allowed))


def test_enumeration_is_bounded_and_starts_near_the_mean_rows():
    shapes = routed_groups.layout_shapes(128, 128, 4096 * 2, 8192, 8192 * 8)
    assert len(shapes) == len(set(shapes)) <= 8 * 4
    assert shapes[0][1] == routed_groups.padded_rows(8192 * 8 // 128)     # 512 rows an expert on average
    levels = {p for _, p in shapes}
    assert levels == {64 << i for i in range(8)}
    assert all(len({g for g, q in shapes if q == p}) <= 4 for p in levels)
    # fewer tokens per forward: no level past them
    assert {p for _, p in routed_groups.layout_shapes(128, 128, 8192, 200, 1600)} == {64, 128, 256}


def _drain_groups(monkeypatch):
    """The group warm-up finished before the calibration goes on (the run then meets only warmed programs)."""
    original = hooks.WarmUp._warm_groups

    def warm_then_wait(self, run, step):
        original(self, run, step)
        for warming in self.group_warmings:
            while True:
                with warming._lock:
                    if not warming.jobs:
                        break
                time.sleep(0.01)
            for t in warming.threads:
                t.join()

    monkeypatch.setattr(hooks.WarmUp, "_warm_groups", warm_then_wait)


def _run(monkeypatch, warm: str, **opts):
    monkeypatch.setenv(solve.ENV_WARM_UP, warm)
    monkeypatch.setattr(routed_groups, "accelerator", lambda device: True)   # the accelerator layout on the CPU
    st._COMPILED.clear()
    jax.clear_caches()
    model = build("qwen3_moe")
    return model, jgptq.quantize_moe(model, CALIB, method="rtn", bits=4, group_size=16, keep_hessians=True,
                                     progress=False, batch_size=4, **opts)


@pytest.mark.parametrize("weighting", ["none", "squared"])
def test_a_warmed_calibration_compiles_no_group_program_same_statistics(weighting, monkeypatch):
    ref_model, ref = _run(monkeypatch, "0", router_weighting=weighting)
    _drain_groups(monkeypatch)
    seen = []

    def listener(event, duration, **kw):
        if event == COMPILE_EVENT and "group_update" in kw.get("fun_name", ""):
            seen.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        model, got = _run(monkeypatch, "1", router_weighting=weighting)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    warmed = [t for t in seen if t.startswith("jgptq-warm-solves")]
    assert warmed, "no group program was compiled ahead"
    assert [t for t in seen if not t.startswith("jgptq-warm-solves")] == []
    assert set(got.hessians) == set(ref.hessians)
    for key, (h, n) in ref.hessians.items():
        assert np.array_equal(np.asarray(h), np.asarray(got.hessians[key][0])) and n == got.hessians[key][1], key
    for name, entry in ref.imatrix.items():
        assert np.array_equal(entry.sums, got.imatrix[name].sums) and np.array_equal(entry.counts,
                                                                                     got.imatrix[name].counts)
    sa, sb = ref_model.state_dict(), model.state_dict()
    assert all(np.array_equal(sa[k].float().numpy(), sb[k].float().numpy()) for k in sa)


def test_no_group_warm_up_on_the_cpu_layout(monkeypatch):
    monkeypatch.setenv(solve.ENV_WARM_UP, "1")
    started = []
    monkeypatch.setattr(warm_groups, "group_jobs", lambda *a, **k: started.append(1) or [])
    jgptq.quantize_moe(build("qwen3_moe", num_hidden_layers=1), CALIB, method="rtn", bits=4, group_size=16,
                       progress=False, batch_size=4)
    assert started == []


def test_a_program_under_way_on_a_worker_is_waited_for_not_compiled_again():
    chain = list(st.calibration("bfloat16").values())
    device = jax.devices()[0]
    states = [s.init(24, 6, device) for s in chain]
    x = jax.device_put(jnp.zeros((1, 1, 24), jnp.bfloat16), device)
    mask = jax.device_put(jnp.zeros((1, 1), bool), device)
    avals = jax.tree.map(st._aval, tuple(states))
    st._COMPILED.clear()
    compiles = []

    def listener(event, duration, **kw):
        if event == COMPILE_EVENT and "group_update" in kw.get("fun_name", ""):
            compiles.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        worker = threading.Thread(target=st.compile_group, args=(chain, avals, 4, 8, x, mask), name="warm")
        worker.start()
        while not st._COMPILED:
            time.sleep(0.001)
        assert st.compile_groups(chain, states, [(4, 8), (2, 16)], x, mask) == 0   # one new: left to its call
        assert st.compile_group(chain, avals, 4, 8, x, mask) is False               # claimed already
        worker.join()
        rows = jnp.ones((4, 8, 24), jnp.bfloat16)
        st.update_group(chain, states, [0, 1, 2, 3], jax.device_put(rows, device),
                        jax.device_put(jnp.ones((4, 8), bool), device))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == ["warm"]     # the one program, by the worker; the update found it compiled
