"""JetMoe: mixtures of MLP experts and of attention experts, each a stack of E matrices in a module of its own
(``JetMoeParallelExperts``), read through ``jgptq_torch.pipeline.stacked_capture``."""

import copy

import numpy as np
import pytest
import torch

import jgptq
from jgptq import statistics
from jgptq_torch import models
from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline.calib import Batch
from jgptq_torch.pipeline.gains import draw_labels, fisher_gains
from tests.export.family_models import build
from tests.tiny_models import next_token_kl, token_ids

transformers = pytest.importorskip("transformers")
STACKS = ("self_attention.experts.input_linear", "self_attention.experts.output_linear", "mlp.input_linear",
          "mlp.output_linear")
CALIB = token_ids(4, 32, seed=1)
HELD_OUT = token_ids(4, 32, seed=2)
_RUNS: dict = {}


def run(method):
    if method not in _RUNS:
        ref = build("jetmoe")
        model = copy.deepcopy(ref)
        result = jgptq.quantize_moe(model, CALIB, method=method, bits=4, group_size=16, batch_size=4,
                                    progress=False)
        _RUNS[method] = (ref, model, result)
    return _RUNS[method]


def test_targets_are_the_four_stacks_and_kv_proj():
    t = models.layer_targets(build("jetmoe").model.layers[0])
    assert set(t.experts) == set(STACKS) and set(t.linears) == {"self_attention.kv_proj"}
    assert {("mlp.router.layer", "router"), ("self_attention.experts.router.layer", "router")} <= set(t.skipped)
    shapes = {m.name: (m.kind, m.count, m.rows, m.cols) for m in t.matrices() if m.layout is not None}
    # hidden 64, 4 experts, intermediate 32 (gate and up: 64 rows), kv_channels 16 x 2 heads = 32
    assert shapes == {"mlp.input_linear.weight": ("expert_stack", 4, 64, 64),
                      "mlp.output_linear.weight": ("expert_stack", 4, 64, 32),
                      "self_attention.experts.input_linear.weight": ("expert_stack", 4, 32, 64),
                      "self_attention.experts.output_linear.weight": ("expert_stack", 4, 64, 32)}


def reference(model, ids, mask, power):
    """Float64 Hessians of layer 0's four stacks from an eager run, each expert's rows taken from first principles:
    the blocks' inputs, each token's top-k experts from its router's logits, the MLP's act(gate)·up computed here,
    the attention output of each (token, slot) pair as the mixture's ``reduce`` is given it; each row weighted by
    its softmax routing weight to ``power``. Returns {stack: [(tokens, Hessian (C, C))] per expert}."""
    layer = model.model.layers[0]
    mlp, moa = layer.mlp, layer.self_attention.experts
    seen = {}
    hooks = [mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("mlp", a[0].detach().clone())),
             layer.self_attention.register_forward_pre_hook(
                 lambda m, a, kw: seen.__setitem__("attn", kw["hidden_states"].detach().clone()), with_kwargs=True)]
    original = type(moa).reduce

    def reduce(self, layer_input, topo_info):
        if self is moa:
            seen["pairs"] = layer_input.detach().clone()        # (B, S, k, heads x kv_channels)
        return original(self, layer_input, topo_info)

    type(moa).reduce = reduce
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        type(moa).reduce = original
        for h in hooks:
            h.remove()
    keep = mask.reshape(-1).bool().numpy()
    k = model.config.num_experts_per_tok
    out = {}

    def routing(block, x):
        with torch.no_grad():
            logits = block.router.layer(x).float()
        top, idx = logits.topk(k, dim=1)
        return idx.numpy(), torch.softmax(top, dim=1).double().numpy()

    def hessians(rows_of, idx, gates):
        got = []
        for e in range(model.config.num_local_experts):
            tok, slot = np.nonzero((idx == e) & keep[:, None])
            x = rows_of(tok, slot)
            w = gates[tok, slot] ** power
            got.append((len(tok), 2 * (w[:, None] * x).T @ x / max(len(tok), 1)))
        return got

    x = seen["mlp"].reshape(-1, seen["mlp"].shape[-1])
    idx, gates = routing(mlp, x)
    x64 = x.double().numpy()
    w_in = mlp.input_linear.weight.detach().double().numpy()
    inter = w_in.shape[1] // 2

    def act(tok, slot):
        e = idx[tok, slot]
        gu = np.einsum("rc,roc->ro", x64[tok], w_in[e])
        g, u = gu[:, :inter], gu[:, inter:]
        return g / (1 + np.exp(-g)) * u

    out["mlp.input_linear"] = hessians(lambda tok, slot: x64[tok], idx, gates)
    out["mlp.output_linear"] = hessians(act, idx, gates)
    a = seen["attn"].reshape(-1, seen["attn"].shape[-1])
    idx, gates = routing(moa, a)
    a64 = a.double().numpy()
    pairs = seen["pairs"].reshape(a64.shape[0], k, -1).double().numpy()
    out["self_attention.experts.input_linear"] = hessians(lambda tok, slot: a64[tok], idx, gates)
    out["self_attention.experts.output_linear"] = hessians(lambda tok, slot: pairs[tok, slot], idx, gates)
    return out


@pytest.mark.parametrize("power", [0, 1], ids=["unweighted", "router_weighted"])
def test_every_expert_hessian_is_over_the_rows_routed_to_it_without_padding(power):
    model = build("jetmoe")
    ids = token_ids(4, 24, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 4:] = 0
    ref = reference(model, ids, mask, power)
    target = models.layer_targets(model.model.layers[0])
    collector = capture.Collector(target.linears, target.experts, statistics.calibration(router_power=power))
    with torch.no_grad(), capture.experts_implementation(model), collector.attach(), collector.batch(mask):
        model(input_ids=ids, attention_mask=mask)
    for stack in STACKS:
        h, n = collector.hessian((stack, "weight"))
        assert n == [r[0] for r in ref[stack]], stack
        assert sum(n) == 2 * int(mask.sum()) and collector.routed[stack] == n
        for e, (_, want) in enumerate(ref[stack]):
            np.testing.assert_allclose(np.asarray(h[e]), want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"{stack}[{e}]")


def test_every_expert_is_solved_with_gptq_written_back_and_the_output_stays_close():
    ref, model, result = run("gptq")
    experts = [r for r in result.report.records if r.kind == "expert_stack"]
    assert len(experts) == 2 * len(STACKS) * 4
    assert all(r.method == "gptq" and not r.fallback and np.isfinite(r.loss) for r in experts if r.tokens)
    state, float_state = model.state_dict(), ref.state_dict()
    for i in range(2):
        for stack in STACKS:
            key = f"model.layers.{i}.{stack}.weight"
            qw = result.weights[key]
            assert qw.codes.shape == (4, *state[key].shape[1:]) and not qw.transposed
            np.testing.assert_array_equal(qw.dequantize(), state[key].numpy(), err_msg=key)   # what the model runs
            assert not torch.equal(state[key], float_state[key])
    with torch.no_grad():
        want, got = ref(HELD_OUT).logits, model(HELD_OUT).logits
    assert float((got - want).norm() / want.norm()) < 0.1
    _, rtn_model, _ = run("rtn")
    kl_gptq, kl_rtn = next_token_kl(ref, model, HELD_OUT), next_token_kl(ref, rtn_model, HELD_OUT)
    assert 0 < kl_gptq < kl_rtn, (kl_gptq, kl_rtn)


def test_all_experts_calibration_is_refused_with_the_reason():
    model = build("jetmoe")
    target = models.layer_targets(model.model.layers[0])
    collector = capture.Collector({}, target.experts, statistics.calibration(all_experts=True))
    ids = token_ids(1, 8, seed=0)
    with torch.no_grad(), capture.experts_implementation(model), collector.attach(), \
            collector.batch(torch.ones_like(ids)), \
            pytest.raises(models.UnsupportedModelError, match="given only their routed rows"):
        model(ids)


def test_exports_of_the_stacks_are_refused_by_name():
    from jgptq_torch.export.checkpoint import ExportError, export_model

    _, model, result = run("gptq")
    for kind in ("compressed-tensors", "gptq"):
        with pytest.raises(ExportError, match=r"input_linear\.weight: JetMoeForCausalLM checkpoints keep every expert "
                                              r"in one fused tensor"):
            export_model(model, result, kind, "/nonexistent/never-written")


def test_fisher_gains_of_the_stacks_are_their_mean_squared_output_gradients():
    model = build("jetmoe", seed=2)
    ids = token_ids(2, 16, seed=4)
    got = fisher_gains(model, [Batch(ids, torch.ones_like(ids))])
    outputs, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        for stack in STACKS:
            def keep(mod, args, out, key=f"model.layers.{i}.{stack}.weight"):
                out.retain_grad()
                outputs[key] = (list(args[1]), out)
            handles.append(layer.get_submodule(stack).register_forward_hook(keep))
    try:
        logits = model(input_ids=ids, use_cache=False).logits.reshape(-1, model.config.vocab_size)
        labels = draw_labels(logits, torch.Generator().manual_seed(0))       # the draws of fisher_gains' pass
        (-torch.log_softmax(logits.float(), -1).gather(1, labels[:, None]).sum()).backward()
    finally:
        for h in handles:
            h.remove()
    assert len(outputs) == 8 and set(outputs) <= set(got)
    for key, (sizes, out) in outputs.items():
        want = [float((g.double() ** 2).mean()) if len(g) else 0.0 for g in out.grad.split(sizes)]
        np.testing.assert_allclose(got[key], want, rtol=1e-4, err_msg=key)
