"""DBRX: experts kept as blocks of rows of three (E·I, H) parameters run by the model's own loop
(``jgptq_torch.row_experts``), read through ``jgptq_torch.pipeline.row_capture``."""

import copy

import numpy as np
import pytest
import torch

import jgptq
from jgptq import statistics
from jgptq_torch import models
from jgptq_torch.pipeline import capture
from tests.tiny_models import build, next_token_kl, token_ids

transformers = pytest.importorskip("transformers")
CALIB = token_ids(4, 32, seed=1)
HELD_OUT = token_ids(4, 32, seed=2)
E, I, H = 4, 32, 64
_RUNS: dict = {}


def run(method):
    if method not in _RUNS:
        ref = build("dbrx")
        model = copy.deepcopy(ref)
        result = jgptq.quantize_moe(model, CALIB, method=method, bits=4, group_size=16, batch_size=4,
                                    progress=False)
        _RUNS[method] = (ref, model, result)
    return _RUNS[method]


def test_targets_are_views_of_each_experts_block_of_rows():
    block = build("dbrx").transformer.blocks[0]
    t = models.layer_targets(block)
    assert set(t.experts) == {"ffn.experts"}
    assert set(t.linears) == {"norm_attn_norm.attn.Wqkv", "norm_attn_norm.attn.out_proj"}
    assert ("ffn.router.layer", "router") in t.skipped
    mats = {m.name: m for m in t.matrices() if m.layout is not None}
    assert {n: (m.kind, m.count, m.rows, m.cols, m.transposed, m.hessian_key) for n, m in mats.items()} == {
        "ffn.experts.mlp.w1": ("expert_gate_up", E, I, H, False, ("ffn.experts", "gate_up")),
        "ffn.experts.mlp.v1": ("expert_gate_up", E, I, H, False, ("ffn.experts", "gate_up")),
        "ffn.experts.mlp.w2": ("expert_down", E, H, I, True, ("ffn.experts", "down"))}
    glu = block.ffn.experts.mlp
    for attr in ("w1", "v1", "w2"):
        view, param = mats[f"ffn.experts.mlp.{attr}"].weight(), getattr(glu, attr).detach()
        assert view.data_ptr() == param.data_ptr()                 # a view: written back in place
        for e in range(E):
            rows = param[e * I:(e + 1) * I]
            assert torch.equal(view[e], rows.T if attr == "w2" else rows), (attr, e)


def reference(model, ids, mask, power, rows=None):
    """Float64 Hessians of block 0's experts from first principles: the FFN's input rows, each token's top-k experts
    and weights from the router's logits (softmax, top-k, divided by their L1 norm), act(x w1ᵀ)·(x v1ᵀ) computed
    here; each row weighted by its routing weight to ``power``. Returns {part: [(tokens, Hessian)] per expert}
    (``rows``: a dict given the rows themselves, {part: [rows (N, C)] per expert})."""
    ffn, seen = model.transformer.blocks[0].ffn, {}
    hook = ffn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        hook.remove()
    x = seen["x"].reshape(-1, H)
    with torch.no_grad():
        probs = torch.softmax(ffn.router.layer(x).double(), dim=1)
    top, idx = probs.topk(model.config.ffn_config.moe_top_k, dim=1)
    gates, idx = (top / top.sum(1, keepdim=True)).numpy(), idx.numpy()
    keep = mask.reshape(-1).bool().numpy()
    x64 = x.double().numpy()
    w1, v1 = (getattr(ffn.experts.mlp, n).detach().double().numpy().reshape(E, I, H) for n in ("w1", "v1"))
    out = {"gate_up": [], "down": [], "down_all": []}

    def down_input(rows, e):
        g = rows @ w1[e].T
        return g / (1 + np.exp(-g)) * (rows @ v1[e].T)

    for e in range(E):
        tok, slot = np.nonzero((idx == e) & keep[:, None])
        xe = x64[tok]
        w = gates[tok, slot] ** power
        for part, x_part in (("gate_up", xe), ("down", down_input(xe, e))):
            out[part].append((len(tok), 2 * (w[:, None] * x_part).T @ x_part / max(len(tok), 1)))
            if rows is not None:
                rows.setdefault(part, []).append(x_part)
        every = down_input(x64[keep], e)
        out["down_all"].append((len(every), 2 * every.T @ every / len(every)))
    return out


@pytest.mark.parametrize("power", [0, 1], ids=["unweighted", "router_weighted"])
def test_every_expert_hessian_is_over_the_rows_routed_to_it_without_padding(power):
    model = build("dbrx")
    ids = token_ids(4, 24, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 4:] = 0
    ref = reference(model, ids, mask, power)
    target = models.layer_targets(model.transformer.blocks[0])
    collector = capture.Collector(target.linears, target.experts, statistics.calibration(router_power=power))
    with torch.no_grad(), capture.experts_implementation(model), collector.attach(), collector.batch(mask):
        model(input_ids=ids, attention_mask=mask)
    for part in ("gate_up", "down"):
        h, n = collector.hessian(("ffn.experts", part))
        assert n == [r[0] for r in ref[part]], part
        assert sum(n) == 2 * int(mask.sum()) and collector.routed["ffn.experts"] == n
        for e, (_, want) in enumerate(ref[part]):
            np.testing.assert_allclose(np.asarray(h[e]), want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{part}[{e}]")


def test_all_experts_calibration_sees_every_token_at_every_expert():
    model = build("dbrx")
    ids = token_ids(2, 16, seed=3)
    mask = torch.ones_like(ids)
    ref = reference(model, ids, mask, 0)
    target = models.layer_targets(model.transformer.blocks[0])
    collector = capture.Collector({}, target.experts, statistics.calibration(all_experts=True))
    with torch.no_grad(), capture.experts_implementation(model), collector.attach(), collector.batch(mask):
        model(input_ids=ids, attention_mask=mask)
    h, n = collector.hessian(("ffn.experts", "gate_up"))            # one state: every token's input
    want = sum(r[1] * r[0] for r in ref["gate_up"]) / (2 * ids.numel())   # each token reaches two experts
    assert n == ids.numel()
    np.testing.assert_allclose(np.asarray(h), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    h_down, n_down = collector.hessian(("ffn.experts", "down"))
    assert list(n_down) == [ids.numel()] * E
    for e, (_, want) in enumerate(ref["down_all"]):
        np.testing.assert_allclose(np.asarray(h_down[e]), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert collector.routed["ffn.experts"] == [r[0] for r in ref["down"]]


def test_gptq_end_to_end_records_are_the_checkpoint_tensors(tmp_path):
    from safetensors.numpy import load_file

    ref, model, result = run("gptq")
    experts = [r for r in result.report.records if r.kind.startswith("expert_")]
    assert len(experts) == 2 * 3 * E
    assert all(r.method == "gptq" and not r.fallback and np.isfinite(r.loss) for r in experts if r.tokens)
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(f))
    for i in range(2):
        for attr in ("w1", "v1", "w2"):
            key = f"transformer.blocks.{i}.ffn.experts.mlp.{attr}"
            rec = result.weights[key]
            assert rec.shape == ((E, H, I) if attr == "w2" else (E, I, H)) and rec.transposed == (attr == "w2")
            stored = rec.dequantize().transpose(0, 2, 1) if rec.transposed else rec.dequantize()
            np.testing.assert_array_equal(stored.reshape(E * I, H), saved[key], err_msg=key)   # experts' rows joined
            assert not np.array_equal(saved[key], ref.get_parameter(key).detach().numpy())
    _, rtn_model, _ = run("rtn")
    # block 0's experts on their own float inputs: GPTQ's output error under round-to-nearest's, for each matrix
    rows: dict = {}
    reference(ref, CALIB, torch.ones_like(CALIB), 0, rows)
    for attr, part in (("w1", "gate_up"), ("v1", "gate_up"), ("w2", "down")):
        key = f"transformer.blocks.0.ffn.experts.mlp.{attr}"
        view = models.layer_targets(ref.transformer.blocks[0])
        m = next(m for m in view.matrices() if m.name == f"ffn.experts.mlp.{attr}")
        w = m.layout.linear(ref.get_parameter(key).detach()).double().numpy()
        errors = {name: sum(float((((m.layout.linear(q.get_parameter(key).detach()).double().numpy()[e] - w[e])
                                    @ x.T) ** 2).sum()) for e, x in enumerate(rows[part]))
                  for name, q in (("gptq", model), ("rtn", rtn_model))}
        assert errors["gptq"] < 0.8 * errors["rtn"], (attr, errors)
    kl = {name: [next_token_kl(ref, q, ids) for ids in (CALIB, HELD_OUT)]
          for name, q in (("gptq", model), ("rtn", rtn_model))}
    assert kl["gptq"][0] < kl["rtn"][0] and max(kl["gptq"] + kl["rtn"]) < 2e-3, kl


def test_exports_are_refused_with_the_reason():
    from jgptq_torch.export.checkpoint import ExportError, export_model
    from jgptq_torch.export.gguf.export import check_exportable
    from jgptq_torch.export.gguf.families import UnsupportedGGUFModel

    _, model, result = run("gptq")
    for kind in ("compressed-tensors", "gptq"):
        with pytest.raises(ExportError, match=r"mlp\.w1: DbrxForCausalLM checkpoints keep every expert in one fused"):
            export_model(model, result, kind, "/nonexistent/never-written")
    with pytest.raises(UnsupportedGGUFModel, match=r"model_type 'dbrx'\) has no GGUF exporter"):
        check_exportable(model)


def test_fisher_gains_are_refused_with_the_reason():
    from jgptq_torch.pipeline.calib import batches
    from jgptq_torch.pipeline.gains import fisher_gains

    with pytest.raises(models.UnsupportedModelError, match="output gradients of experts kept as blocks of rows"):
        fisher_gains(build("dbrx"), batches(token_ids(2, 8, seed=0), batch_size=2))
