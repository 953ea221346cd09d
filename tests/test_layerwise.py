import copy
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import jgptq
from jgptq_torch.models import UnsupportedModelError
from jgptq.export import QuantizedWeight
from tests.tiny_models import build, next_token_kl, token_ids

CALIB = token_ids(16, 32, seed=1)
HELD_OUT = token_ids(8, 32, seed=2)
OPTS = dict(bits=3, group_size=16, batch_size=8, progress=False)
FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "llama"]
ROUTER_KEY = re.compile(r"\.(gate|router|shared_expert_gate)\.weight$")
_RUNS: dict = {}


def run(family, method):
    """(float model, quantized model, result), cached for the module (each run costs compiles)."""
    key = (family, method)
    if key not in _RUNS:
        ref = build(family)
        model = copy.deepcopy(ref)
        _RUNS[key] = (ref, model, jgptq.quantize_moe(model, CALIB, method=method, **OPTS))
    return _RUNS[key]


def checkpoint_tensors(model):
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {k: v.detach() for k, v in model.state_dict().items()})


def assert_every_target_on_grid(model, result):
    ckpt = checkpoint_tensors(model)
    expected = {k for k, v in ckpt.items()
                if ".layers." in k and v.ndim >= 2 and not ROUTER_KEY.search(k) and not k.endswith("bias")}
    assert set(result.weights) == expected
    for key, qw in result.weights.items():
        assert isinstance(qw, QuantizedWeight)          # the exporters' record type
        assert qw.codes.dtype == np.uint8 and qw.codes.max() <= 2 ** qw.bits - 1
        stored = ckpt[key].float().numpy()
        if qw.transposed:
            stored = np.swapaxes(stored, -1, -2)
        np.testing.assert_array_equal(qw.dequantize(), stored, err_msg=key)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_target_is_quantized_on_its_grid_and_named_as_in_checkpoints(family):
    _, model, result = run(family, "gptq")
    assert_every_target_on_grid(model, result)
    records = result.report.records
    assert all(r.method == "gptq" and not r.fallback and np.isfinite(r.loss) for r in records)
    if family != "llama":
        n_moe = sum(1 for k in result.report.coverage)
        assert n_moe == (1 if family == "deepseek_v3" else 2)
        for name, counts in result.report.coverage.items():
            assert sum(counts) == 2 * CALIB.numel()       # top-2 routing, no padding
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in result.weights
    else:
        assert "model.layers.1.mlp.down_proj.weight" in result.weights or \
            "model.layers.1.mlp.experts.0.down_proj.weight" in result.weights


@pytest.mark.parametrize("family", FAMILIES)
def test_gptq_beats_round_to_nearest_on_held_out_next_token_kl(family):
    ref, gptq_model, _ = run(family, "gptq")
    _, rtn_model, rtn = run(family, "rtn")
    assert all(r.method == "rtn" for r in rtn.report.records)
    kl_gptq, kl_rtn = next_token_kl(ref, gptq_model, HELD_OUT), next_token_kl(ref, rtn_model, HELD_OUT)
    assert 0 < kl_gptq < 0.9 * kl_rtn, (kl_gptq, kl_rtn)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen2_moe"])
def test_other_layouts_round_to_nearest_on_grid(family):
    model = build(family)
    result = jgptq.quantize_moe(model, CALIB[:4], method="rtn", **OPTS)
    assert_every_target_on_grid(model, result)
    if family == "gpt_oss":
        qw = result.weights["model.layers.0.mlp.experts.gate_up_proj"]
        assert qw.transposed and qw.codes.shape == (4, 64, 64)


def test_report_serializes_and_summarizes(tmp_path):
    _, _, result = run("qwen3_moe", "gptq")
    path = tmp_path / "report.json"
    text = result.report.to_json(str(path))
    data = json.loads(path.read_text())
    assert data == json.loads(text)
    assert len(data["records"]) == len(result.report.records) == 2 * (4 + 16)
    assert set(data["stage_totals"]) == {"capture", "calibrate", "solve", "write", "store", "replay"}
    assert all("store" in data["timings"][str(i)] for i in range(2))   # every layer's records were waited for
    rec = data["records"][0]
    assert {"loss", "damp_used", "damp_stage", "fallback", "tokens", "dead_columns"} <= set(rec)
    summary = str(result)
    assert "expert coverage" in summary and "model.layers.1.mlp.experts: 8 experts" in summary


def test_under_calibrated_experts_fall_back_to_round_to_nearest_with_a_warning():
    _, rtn_model, _ = run("qwen3_moe", "rtn")
    model = build("qwen3_moe")
    with pytest.warns(UserWarning, match="round-to-nearest"):
        result = jgptq.quantize_moe(model, CALIB, min_tokens=10**6, **OPTS)
    experts = [r for r in result.report.records if r.kind.startswith("expert")]
    assert experts and all(r.method == "rtn" and "tokens <" in r.reason and np.isnan(r.loss) for r in experts)
    assert all(r.method == "gptq" for r in result.report.records if r.kind == "linear")
    assert len(result.report.fallbacks()) == len(experts)
    # layer 0 sees the same float inputs in both runs: its experts equal the round-to-nearest baseline exactly
    for name in ("gate_up_proj", "down_proj"):
        a = getattr(model.model.layers[0].mlp.experts, name)
        b = getattr(rtn_model.model.layers[0].mlp.experts, name)
        assert torch.equal(a, b)
    assert "below 1000000" in str(result.report)


def test_expert_never_routed_to_is_reported_and_the_model_stays_valid():
    from jgptq import QuantConfig
    from jgptq.quantizers import uniform

    model = build("deepseek_v3")
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias[3] = -100.0
    original = model.model.layers[1].mlp.experts.down_proj[3].detach().clone()
    with pytest.warns(UserWarning, match=r"experts \[3\]"):
        result = jgptq.quantize_moe(model, CALIB[:4], **OPTS)
    cov = result.report.coverage["model.layers.1.mlp.experts"]
    assert cov[3] == 0 and min(c for e, c in enumerate(cov) if e != 3) > 0
    rec = {r.name: r for r in result.report.records}
    never = rec["model.layers.1.mlp.experts.down_proj[3]"]
    assert never.method == "rtn" and never.reason == "0 tokens < 1" and never.tokens == 0
    assert rec["model.layers.1.mlp.experts.down_proj[2]"].method == "gptq"
    _, _, rtn = uniform.round_to_nearest(original.numpy(), QuantConfig(bits=3, group_size=16))
    np.testing.assert_array_equal(model.model.layers[1].mlp.experts.down_proj[3].detach().numpy(), np.asarray(rtn))
    assert_every_target_on_grid(model, result)
    with torch.no_grad():
        assert torch.isfinite(model(HELD_OUT).logits).all()


def test_bad_inputs_get_clear_errors():
    llama = build("llama")
    with pytest.raises(ValueError, match="nothing to quantize"):
        jgptq.quantize_moe(llama, CALIB, exclude=[".*"], **OPTS)
    with pytest.raises(ValueError, match="zero tokens"):
        jgptq.quantize_moe(llama, {"input_ids": CALIB[:2], "attention_mask": torch.zeros_like(CALIB[:2])}, **OPTS)
    with pytest.raises(ValueError, match="empty"):
        jgptq.quantize_moe(llama, [], **OPTS)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj: 64 input columns are not a multiple of "
                                         r"group_size 48"):
        jgptq.quantize_moe(llama, CALIB, **{**OPTS, "group_size": 48})
    with pytest.raises(ValueError, match="needs a tokenizer"):
        jgptq.quantize_moe(llama, ["some text"], **OPTS)
    with pytest.raises(TypeError, match="unknown option 'bitz'"):
        jgptq.quantize_moe(llama, CALIB, bitz=3)
    broken = build("llama")
    with torch.no_grad():
        broken.model.embed_tokens.weight[int(CALIB[0, 0])] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.\w+_proj.*Hessian contains NaN or Inf"):
        jgptq.quantize_moe(broken, CALIB, **OPTS)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.bank = torch.nn.Parameter(torch.zeros(4, 8, 8))

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

    with pytest.raises(UnsupportedModelError, match=r"bank .*3-D weight \(4, 8, 8\) outside an experts module"):
        jgptq.quantize_moe(Toy(), CALIB, **OPTS)


def test_calibration_forms_and_padding():
    from jgptq_torch.pipeline import calib

    class Tok:
        pad_token_id = 7

        def __call__(self, text, **kw):
            ids = [ord(c) % 100 for c in text][: kw.get("max_length") or None]
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    b = calib.batches(["abc", "hello world"], tokenizer=Tok(), batch_size=8)
    assert len(b) == 1 and b[0].input_ids.shape == (2, 11) and calib.token_count(b) == 14
    assert b[0].input_ids[0, 3:].eq(7).all() and b[0].attention_mask[0, 3:].eq(0).all()
    b = calib.batches([torch.arange(5), torch.arange(9), torch.arange(3)], batch_size=2)
    assert [x.input_ids.shape for x in b] == [(2, 9), (1, 3)] and calib.token_count(b) == 17
    b = calib.batches({"input_ids": [[1, 2, 3], [4, 5]], "attention_mask": [[1, 1, 0], [1, 1]]})
    assert calib.token_count(b) == 4
    assert calib.token_count(calib.batches(torch.ones(3, 4, dtype=torch.long), max_length=2)) == 6
    with pytest.raises(TypeError, match="integers"):
        calib.batches(torch.ones(2, 3))
    result = jgptq.quantize_moe(build("llama"), "a short calibration text", tokenizer=Tok(), method="rtn",
                                **OPTS)
    assert result.report.calibration_tokens == len("a short calibration text")


SUBPROCESS = textwrap.dedent("""
    import sys, numpy as np, jax
    sys.path.insert(0, {root!r})
    assert jax.device_count() == 4, jax.devices()
    import jgptq
    from tests.tiny_models import build, token_ids
    model = build("qwen3_moe")
    jgptq.quantize_moe(model, token_ids(16, 32, seed=1), devices=jax.devices(), method="gptq",
                       bits=3, group_size=16, batch_size=8, progress=False)
    np.savez({out!r}, **{{k: v.detach().numpy() for k, v in model.state_dict().items()}})
""")


def test_same_weights_with_one_and_four_devices(tmp_path):
    _, model, _ = run("qwen3_moe", "gptq")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "four.npz")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS.format(root=root, out=out)], env=env, timeout=600,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    four = np.load(out)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(four[k], v.detach().numpy(), err_msg=k)


def test_solve_programs_compiled_ahead_are_the_ones_the_solve_runs(monkeypatch):
    """The first layer's solve programs are compiled on a background thread during its calibration (on
    accelerators; forced here): the solve then compiles nothing new, and the bytes are those of a run without."""
    from jgptq_torch.pipeline import solve
    from jgptq.parallel import engine
    from tests.cli import test_resume as resume_tests

    float_model = build("qwen3_moe", num_hidden_layers=1)
    ref = copy.deepcopy(float_model)
    calib = resume_tests.CALIB[:4]
    full = jgptq.quantize_moe(ref, calib, **resume_tests.OPTS)
    engine._compiled.clear()
    monkeypatch.setenv(solve.ENV_WARM_UP, "1")
    from tests.test_warm_up import _drained_join      # every job compiled, whatever the host's cores
    monkeypatch.setattr(solve.Warming, "join", _drained_join)
    seen = {}
    solve_layer = solve.solve_layer

    def watch(*args, **kwargs):
        seen.setdefault("before", set(engine._compiled))
        out = solve_layer(*args, **kwargs)
        seen.setdefault("after", set(engine._compiled))
        return out

    monkeypatch.setattr(solve, "solve_layer", watch)
    model = copy.deepcopy(float_model)
    result = jgptq.quantize_moe(model, calib, **resume_tests.OPTS)
    resume_tests.assert_same(ref, full, model, result)
    assert seen["before"] and seen["after"] <= seen["before"]
