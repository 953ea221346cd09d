"""jgptq.parallel: same bytes on 1, 2, 4, 8 simulated CPU devices and across two processes; room check.

Multi-device runs happen in subprocesses (tests/parallel_worker.py) with XLA_FLAGS forcing N host devices, each
under a timeout; the references are computed here, on this process's single CPU device, with the plain
(one-device, vmapped) :func:`jgptq.gptq.solve_experts`.
"""

import gc
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jgptq.parallel as jp
from jgptq import QuantConfig, gptq
from jgptq import hessian as hs
from jgptq.ggml import get_format
from jgptq import xla_options
from jgptq.parallel import engine, experts, memory
from tests import parallel_worker
from tests.conftest import correlated_activations

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# lazy grids and a reordered solve: the configuration most sensitive to how the program is compiled
CFG = QuantConfig(bits=4, group_size=16, block_size=32, act_order="group_aware")
E, R, C, T = 8, 16, 64, 128
TIMEOUT = 240


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((E, R, C)).astype(np.float32)
    x = np.stack([correlated_activations(rng, T, C) for _ in range(E)])
    h = np.stack([np.asarray(hs.finalize(hs.from_activations(xe))) for xe in x])
    imp = np.exp(rng.uniform(-1, 1, (E, C))).astype(np.float32)
    d = tmp_path_factory.mktemp("parallel")
    path = str(d / "inputs.npz")
    np.savez(path, weights=w, hessians=h, activations=x, importance=imp)
    np.savez(path.replace(".npz", "_cfg.npz"), **{k: np.asarray(v) for k, v in CFG.__dict__.items()})
    return dict(w=w, h=h, x=x, imp=imp, path=path, dir=d)


@pytest.fixture(scope="module")
def reference(problem):
    return gptq.solve_experts(problem["w"], problem["h"], CFG)


def run_worker(problem, scenario, devices, *extra, tag=""):
    out = str(problem["dir"] / f"{scenario}{devices}{tag}.npz")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env.pop("JGPTQ_DEVICE_MEMORY_LIMIT", None)
    cmd = [sys.executable, "-m", "tests.parallel_worker", problem["path"], out, scenario, *extra]
    return cmd, env, out


def call_worker(problem, scenario, devices, *extra):
    cmd, env, out = run_worker(problem, scenario, devices, *extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(out))


def assert_same_bytes(got: dict, prefix: str, ref):
    fields = {k: v for k, v in ref._asdict().items() if v is not None}
    assert {k.split("/", 1)[1] for k in got if k.startswith(prefix + "/")} == set(fields)
    for k, v in fields.items():
        a, b = got[f"{prefix}/{k}"], np.asarray(v)
        assert a.dtype == b.dtype and a.shape == b.shape, (prefix, k)
        assert a.tobytes() == b.tobytes(), f"{prefix}/{k} differs from the one-device solve"


def take(res, n):
    return jax.tree.map(lambda a: np.asarray(a)[:n], res)


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_same_bytes_on_1_2_4_8_devices(problem, reference, devices):
    extras = devices == 4     # uneven counts, tied Hessians and encodes on one mesh only (compile time)
    got = call_worker(problem, "devices", devices, *(["--extras"] if extras else []))
    assert int(got["num_devices"]) == devices
    assert_same_bytes(got, "all", reference)
    if not extras:
        return
    assert_same_bytes(got, "uneven", take(reference, E - 1))          # padded with dummies, dropped
    assert_same_bytes(got, "tied", gptq.solve_experts(problem["w"], problem["h"][0], CFG))
    enc = jax.vmap(parallel_worker._rtn_encode)(problem["w"], problem["imp"])
    assert_same_bytes(got, "encode", _Enc(*enc))
    assert bool(got["encode_devices_ok"])
    for i in range(E):
        one = jax.jit(parallel_worker._rtn_encode)(problem["w"][i], problem["imp"][i])
        assert_same_bytes(got, f"encode_dev{i}", _Enc(*one))
    q4_0 = get_format("q4_0")
    ggml = np.stack([np.asarray(jax.jit(q4_0.encode)(problem["w"][i], problem["imp"][i])) for i in range(E)])
    assert got["ggml_encode"].tobytes() == ggml.tobytes()
    assert_same_bytes(got, "ggml_gptq", gptq.solve_experts(problem["w"], problem["h"], QuantConfig(format="q4_0"),
                                                           importance=problem["imp"]))


class _Enc(tuple):
    def __new__(cls, codes, scale, zero):
        return super().__new__(cls, (codes, scale, zero))

    def _asdict(self):
        return dict(zip(("codes", "scale", "zero"), self))


def test_room_check_chunks_idles_and_merges_partials(problem, reference):
    got = call_worker(problem, "room", 4)
    assert int(got["plan_idle"]) >= 1 and bool(got["idle_is_dev3"])        # the device without room: no work
    assert int(got["plan_chunks"]) > 1                                      # the bucket did not fit at once
    assert int(got["plan_peak"]) <= int(got["plan_limit"]) < int(got["full_peak"])
    assert_same_bytes(got, "room", reference)
    assert (int(got["reuse_devices"]), int(got["reuse_compiled"])) == (3, 0)   # a compiled program reused
    assert int(got["two_devices"]) == 2                                         # ...that spreads the experts
    assert_same_bytes(got, "reuse", take(reference, E - 1))
    assert bool(got["merged_on_plan"])
    merged = got["merged_hessians"]
    np.testing.assert_allclose(merged, problem["h"], rtol=2e-5, atol=1e-5)  # partials sum to the statistic
    assert_same_bytes(got, "merged", gptq.solve_experts(problem["w"], merged, CFG))
    assert bool(got["memory_error"])                                         # no room anywhere: clear error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_give_the_same_bytes(problem, reference):
    port = str(_free_port())
    procs = []
    for pid in range(2):
        cmd, env, out = run_worker(problem, "multiprocess", 2, "--processes", "2", "--process-id", str(pid),
                                   "--port", port, tag=f"p{pid}")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True), out))
    try:
        for p, _ in procs:
            _, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
    got = dict(np.load(procs[0][1]))
    assert int(got["num_devices"]) == 4                                      # 2 processes x 2 devices
    assert_same_bytes(got, "all", reference)


# ---- in this process (one CPU device) -------------------------------------------------------------------------

def as_got(res, prefix="x") -> dict:
    return {f"{prefix}/{k}": np.asarray(v) for k, v in res._asdict().items() if v is not None}


def test_batched_map_and_unbatched_solve_give_the_same_bytes(problem, reference):
    res = jp.solve_experts(problem["w"], problem["h"], CFG, devices=jax.devices()[:1], batch_size=2)
    assert_same_bytes(as_got(res), "x", reference)                          # lax.map with a vmap of 2 per step
    one = gptq.solve(problem["w"][3], problem["h"][3], CFG)                 # the unbatched program
    assert_same_bytes(as_got(one), "x", jax.tree.map(lambda a: np.asarray(a)[3], reference))
    single = gptq.solve_experts(problem["w"][3:4], problem["h"][3:4], CFG)  # one expert: never a vmap of 1
    assert_same_bytes(as_got(single), "x", take(jax.tree.map(lambda a: np.asarray(a)[3:], reference), 1))


def test_predicted_peak_bounds_the_compiled_program_and_the_chunked_run_fits(problem, reference):
    s = jax.ShapeDtypeStruct
    spec, _ = engine.make_spec(experts._Solver(CFG), (s((E, R, C), jnp.float32), s((E, C, C), jnp.float32), None),
                               (0, 0, None))
    io = engine.io_bytes(spec)
    mesh = engine.expert_mesh(jax.devices()[:1])
    peak = lambda m: memory.program_peak(engine.compiled_program(spec, mesh, m, 1))
    # the plan's model: fixed bytes (from a two-step program) plus inputs and outputs per expert
    fixed = peak(2) - 2 * io
    assert fixed > 0 and fixed + 4 * io >= peak(4) > peak(2)
    # a simulated limit that holds about 3 experts beside what this process already holds: the bucket runs in
    # chunks, each within the limit
    gc.collect()
    limit = memory.live_bytes(jax.devices()[:1]).get(jax.devices()[0], 0) + fixed + 3 * io
    plan = jp.plan_solve(problem["w"], problem["h"], CFG, devices=jax.devices()[:1], memory_limit=limit,
                         gather_to="host")
    assert plan.num_chunks > 1 and 1 <= plan.per_device <= 3
    assert plan.predicted_peak <= limit
    res = jp.solve_experts(problem["w"], problem["h"], CFG, plan=plan, gather_to="host")
    assert_same_bytes(as_got(res), "x", reference)


def test_simulated_limits_and_errors(problem, monkeypatch):
    dev = jax.devices()[0]
    assert memory.parse_bytes("2M") == 2 << 20 and memory.parse_bytes("1.5KiB") == 1536
    assert memory.parse_bytes(123) == 123
    with pytest.raises(ValueError, match="K/M/G"):
        memory.parse_bytes("lots")
    if dev.memory_stats() is None:
        assert memory.free_bytes([dev])[dev] == memory.UNLIMITED
        gc.collect()
        held = memory.live_bytes([dev]).get(dev, 0)  # what earlier tests of this process still hold
        keep = jax.device_put(np.zeros(1 << 16, np.float32), dev)
        monkeypatch.setenv(memory.ENV_LIMIT, str(held + (1 << 20)))
        free = memory.free_bytes([dev])[dev]
        assert 0 < free <= (1 << 20) - keep.nbytes
        assert memory.free_bytes([dev], reserve=1000)[dev] == free - 1000
        with memory.granted({dev: held + (2 << 20)}):                  # a grant comes before the environment
            assert memory.free_bytes([dev])[dev] == free + (1 << 20)
            with memory.granted(None):                                  # an inner block without one: the environment
                assert memory.free_bytes([dev])[dev] == free
            assert memory.free_bytes([dev], memory_limit=held + (3 << 20))[dev] == free + (2 << 20)  # the argument wins
        assert memory.free_bytes([dev])[dev] == free                    # the block's end restores it
    with pytest.raises(ValueError, match="Hessians for"):
        jp.solve_experts(problem["w"], problem["h"][:3], CFG)
    with pytest.raises(ValueError, match="disagree on the number of experts"):
        jp.solve_experts(list(problem["w"][:2]), list(problem["h"][:3]), CFG, check=False)
    with pytest.raises(MemoryError, match="no device has room.*the memory_limit argument"):
        jp.plan_solve(problem["w"], problem["h"], CFG, devices=[dev], memory_limit=1000)
    with memory.granted(1000), pytest.raises(MemoryError, match=r"limit \(1000 bytes .*granted to this solve"):
        jp.plan_solve(problem["w"], problem["h"], CFG, devices=[dev])


def test_bucket_by_shape_and_solve_named(problem, reference):
    rng = np.random.default_rng(3)
    named = {"e0.up": problem["w"][0], "e0.down": rng.standard_normal((C, R * 2)).astype(np.float32),
             "e1.up": problem["w"][1]}
    hx = correlated_activations(rng, T, R * 2)
    hess = {"e0.up": problem["h"][0], "e1.up": problem["h"][1],
            "e0.down": np.asarray(hs.finalize(hs.from_activations(hx)))}
    assert jp.bucket_by_shape(named) == {((R, C), "float32"): ["e0.up", "e1.up"],
                                         ((C, R * 2), "float32"): ["e0.down"]}
    out = jp.solve_named(named, hess, CFG, devices=jax.devices()[:1])
    for i, k in enumerate(["e0.up", "e1.up"]):
        assert np.asarray(out[k].codes).tobytes() == np.asarray(reference.codes[i]).tobytes()
        assert np.asarray(out[k].weight).tobytes() == np.asarray(reference.weight[i]).tobytes()
    down = gptq.solve(named["e0.down"], hess["e0.down"], CFG)
    assert np.asarray(out["e0.down"].weight).tobytes() == np.asarray(down.weight).tobytes()


def test_accelerator_policy_width_slack_and_compiler_options(monkeypatch):
    # The vmap width: the experts per device up to the bound; never the unbatched program (width 1) on an
    # accelerator while a bucket has two experts or more (its kernels differ from the batched ones on GPUs).
    assert engine._width(256, 64, 128, "gpu") == 64
    assert engine._width(256, 1, 3, "gpu") == 2
    assert engine._width(256, 1, 1, "gpu") == 1          # a lone expert: nothing to batch with
    assert engine._width(1, 1, 3, "gpu") == 1            # an explicit batch_size=1 is obeyed
    assert engine._width(1, 4, 8, "cpu") == 1
    # Runtime slack: none on CPU (simulated limits are exact there), per vmap lane on accelerators.
    assert engine.runtime_slack("cpu", 10 ** 6, 4) == 0
    assert engine.runtime_slack("gpu", 10 ** 6, 4) == 4 * 2 * 10 ** 6 + (1 << 20)
    assert engine.runtime_slack("gpu", 10 ** 6, 2) < engine.runtime_slack("gpu", 10 ** 6, 4)
    # GEMMs from cuBLAS on GPUs unless asked otherwise; nothing on CPU. XLA accepts the option when compiling.
    monkeypatch.delenv(xla_options.ENV_TRITON_GEMM, raising=False)
    opts = engine.compiler_options("gpu")
    assert opts == {"xla_gpu_enable_triton_gemm": False}
    assert engine.compiler_options("cpu") is None
    monkeypatch.setenv(xla_options.ENV_TRITON_GEMM, "1")
    assert engine.compiler_options("gpu") is None
    x = jnp.arange(16.0).reshape(4, 4)
    compiled = jax.jit(lambda a: a @ a).lower(x).compile(compiler_options=opts)
    np.testing.assert_array_equal(np.asarray(compiled(x)), np.asarray(x) @ np.asarray(x))


def test_a_limited_bucket_reuses_a_compiled_program_that_fits_instead_of_compiling_new_ones(problem, reference,
                                                                                               monkeypatch):
    dev = jax.devices()[0]
    s = jax.ShapeDtypeStruct
    spec, _ = engine.make_spec(experts._Solver(CFG), (s((E, R, C), jnp.float32), s((E, C, C), jnp.float32), None),
                               (0, 0, None))
    # the planner starts from none of this bucket's programs, whichever tests ran before in this process
    for key in [k for k in engine._compiled if k[0] == spec]:
        monkeypatch.delitem(engine._compiled, key)
    io = engine.io_bytes(spec)
    mesh = engine.expert_mesh([dev])
    fixed = memory.program_peak(engine.compiled_program(spec, mesh, 2, 1)) - 2 * io
    gc.collect()
    limit = memory.live_bytes([dev]).get(dev, 0) + fixed + 3 * io
    first = jp.plan_solve(problem["w"], problem["h"], CFG, devices=[dev], memory_limit=limit, gather_to="host")
    assert first.num_chunks > 1
    programs = lambda: {k for k in engine._compiled if k[0] == spec}
    before = programs()
    # one expert fewer (a chunk of 7 after chunks of 8) and a little more room: the same program, no compile
    seven = jp.plan_solve(problem["w"][:7], problem["h"][:7], CFG, devices=[dev], memory_limit=limit + io // 2,
                          gather_to="host")
    assert programs() == before
    assert (spec, engine.expert_mesh([dev]), seven.per_device, seven.batch_size) in before
    assert seven.num_chunks == -(-7 // seven.per_device) > 1 and seven.predicted_peak <= limit
    res = jp.solve_experts(problem["w"][:7], problem["h"][:7], CFG, plan=seven, gather_to="host")
    assert_same_bytes(as_got(res), "x", take(reference, 7))
    # one expert: the planner's one-expert probe, without padding
    one = jp.plan_solve(problem["w"][:1], problem["h"][:1], CFG, devices=[dev], memory_limit=limit,
                        gather_to="host")
    assert (one.per_device, one.num_chunks) == (1, 1) and programs() == before
    # without a limit the bucket's own program is compiled as before
    whole = jp.plan_solve(problem["w"][:7], problem["h"][:7], CFG, devices=[dev], gather_to="host")
    assert (whole.per_device, whole.num_chunks) == (7, 1)


def test_a_narrow_compiled_program_is_not_reused_where_the_room_holds_a_wider_batch(problem, reference):
    # A program compiled while memory was short (2 experts at batch 2) fits a later, roomier bucket, but would
    # take 4 sequential steps there where the room holds batch 4 (2 steps, by the batch-4 program's peak): the
    # planner plans anew instead of reusing it, and the bytes are the one-device solve's.
    dev = jax.devices()[0]
    s = jax.ShapeDtypeStruct
    spec, _ = engine.make_spec(experts._Solver(CFG), (s((E, R, C), jnp.float32), s((E, C, C), jnp.float32), None),
                               (0, 0, None))
    io, mesh = engine.io_bytes(spec), engine.expert_mesh([dev])
    whole, narrow = engine.program_peak(spec, mesh, E, 4), engine.program_peak(spec, mesh, 2, 2)
    gc.collect()
    live = memory.live_bytes([dev]).get(dev, 0)
    short = jp.plan_solve(problem["w"], problem["h"], CFG, devices=[dev], batch_size=2, memory_limit=live + narrow,
                          gather_to="host")
    assert (short.per_device, short.batch_size, short.num_chunks) == (2, 2, E // 2)
    roomy = jp.plan_solve(problem["w"], problem["h"], CFG, devices=[dev], batch_size=4,
                          memory_limit=live + whole - 2 * io, gather_to="host")
    assert roomy.batch_size == 4 and roomy.num_chunks * -(-roomy.per_device // 4) == 2
    assert (spec, mesh, roomy.per_device, 4) in engine._compiled
    res = jp.solve_experts(problem["w"], problem["h"], CFG, plan=roomy, gather_to="host")
    assert_same_bytes(as_got(res), "x", reference)


def test_a_new_expert_count_compiles_no_program_per_result_field(problem, reference):
    # A chunked bucket whose count is new (a layer's shorter last chunks) runs the program compiled before; cutting
    # its results to the real experts and joining the chunks is one program each for every field at once, not an
    # eager slice and concatenation per field (about twenty small compiles, seconds on a GPU). Same bytes.
    import logging

    dev = jax.devices()[0]
    w, h = jnp.asarray(problem["w"]), jnp.asarray(problem["h"])
    jp.solve_experts(w, h, CFG, plan=engine.Plan((dev,), 3, 1, E, 3, 0, {}), gather_to=dev)   # chunks 3, 3, 2
    compiles = []

    class Count(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling"):
                compiles.append(record.getMessage().split(" with ")[0])

    handler, jax_log = Count(), logging.getLogger("jax")
    jax_log.addHandler(handler)
    w7, h7 = w[:7], h[:7]
    try:
        with jax.log_compiles(True):                                                           # chunks 3, 3, 1
            res = jp.solve_experts(w7, h7, CFG, plan=engine.Plan((dev,), 3, 1, 7, 3, 0, {}), gather_to=dev)
    finally:
        jax_log.removeHandler(handler)
    # the input checks' finiteness and the chunks' experts taken from the stacks (weights, Hessians: one program
    # each), the last chunk cut to its real experts, the chunks joined
    assert len(compiles) <= 6, compiles
    assert_same_bytes(as_got(res), "x", take(reference, 7))
