import numpy as np
import pytest
import torch

from jgptq_torch.pipeline import capture
from jgptq_torch.pipeline import experts_capture, routed_groups
from jgptq_torch import models
from jgptq import statistics
from tests.tiny_models import build, token_ids


def all_experts_modules(model):
    return {n: (m, models.ExpertsLayout.of(m)) for n, m in model.named_modules() if models.is_experts_module(m)}


def logits_with(model, ids, impl, collector=None):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        if collector is None:
            return model(ids).logits
        with collector.attach(), collector.batch(torch.ones_like(ids)):
            return model(ids).logits


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_capture_implementation_computes_the_eager_output(family, grouped, monkeypatch):
    # grouped: the accelerator path (two grouped matrix products for all experts), here on the CPU
    monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype: grouped)
    model = build(family)
    ids = token_ids(2, 12, seed=3)
    eager = logits_with(model, ids, "eager")
    capture._register()
    plain = logits_with(model, ids, capture.IMPLEMENTATION)
    torch.testing.assert_close(plain, eager, rtol=0, atol=2e-6)
    experts = all_experts_modules(model)
    routed = logits_with(model, ids, capture.IMPLEMENTATION, capture.Collector({}, experts))
    every = logits_with(model, ids, capture.IMPLEMENTATION, capture.Collector({}, experts, statistics.calibration(all_experts=True)))
    assert torch.equal(routed, plain) and torch.equal(every, plain)  # all-experts keeps the routed output exactly


def test_layout_flags_are_read_from_the_modules():
    lay = models.ExpertsLayout.of(build("gpt_oss").model.layers[0].mlp.experts)
    assert (lay.transposed, lay.concatenated, lay.biased, lay.gated) == (True, False, True, True)
    assert (lay.num_experts, lay.hidden, lay.inter) == (4, 64, 32)
    assert lay.gate_up_rows() == (slice(0, 64, 2), slice(1, 64, 2))
    lay = models.ExpertsLayout.of(build("qwen3_moe").model.layers[0].mlp.experts)
    assert (lay.transposed, lay.concatenated, lay.biased) == (False, True, False)
    assert lay.gate_up_rows() == (slice(0, 32), slice(32, 64))


def test_routers_and_shared_expert_gates_are_not_targets():
    t = models.layer_targets(build("qwen2_moe").model.layers[0])
    assert "mlp.shared_expert_gate" not in t.linears and ("mlp.shared_expert_gate", "router") in t.skipped
    assert {"mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "self_attn.q_proj"} <= set(t.linears)
    assert list(t.experts) == ["mlp.experts"]
    assert any(n == "mlp.gate.weight" for n, _ in t.skipped)     # the router's plain parameter stays float
    t = models.layer_targets(build("gpt_oss").model.layers[0])
    assert "mlp.router" not in t.linears and list(t.experts) == ["mlp.experts"]


def reference_layer0(model, ids, mask, power=0):
    """Float64 Hessians of layer 0's experts, from hooks on an eager run (independent of the capture path); with
    ``power``, each routed token's products weighted by its routing weight to that power."""
    mlp = model.model.layers[0].mlp
    seen = {}
    h1 = mlp.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach().clone()))
    h2 = mlp.gate.register_forward_hook(lambda m, a, o: seen.update(idx=o[2].detach().clone(),
                                                                    p=o[1].detach().double().clone()))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    h1.remove()
    h2.remove()
    x = seen["x"].reshape(-1, seen["x"].shape[-1]).double().numpy()
    idx, p = seen["idx"].numpy(), seen["p"].numpy()
    keep = mask.reshape(-1).bool().numpy()
    gate_up = mlp.experts.gate_up_proj.detach().double().numpy()
    inter = mlp.experts.down_proj.shape[-1]
    out = []
    for e in range(gate_up.shape[0]):
        rows = keep & (idx == e).any(-1)
        xe = x[rows]
        w = (p * (idx == e)).sum(-1)[rows] ** power           # the routing weight of expert e on each token
        g, u = xe @ gate_up[e, :inter].T, xe @ gate_up[e, inter:].T
        act = g / (1 + np.exp(-g)) * u
        out.append((int(rows.sum()), 2 * (w[:, None] * xe).T @ xe / max(len(xe), 1),
                    2 * (w[:, None] * act).T @ act / max(len(xe), 1)))
    return out


@pytest.mark.parametrize("grouping", ["one_group", "small_groups_and_passes", "accelerator_slots"])
def test_expert_hessians_equal_a_float64_reference_and_exclude_padding(grouping, monkeypatch):
    import jgptq

    if grouping == "accelerator_slots":
        # the accelerator policies: last groups padded to at least an eighth of a level's largest group (empty
        # slots add nothing), the experts' forward as grouped matrix products
        monkeypatch.setattr(routed_groups, "accelerator", lambda device: True)
        monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype: True)
    if grouping != "one_group":
        # experts accumulated a few at a time, their rows in several passes of 64 (the bucket floor)
        monkeypatch.setattr(routed_groups, "GROUP_BYTES", 64 * 64 * 4 * 3 if grouping != "accelerator_slots" else
                            64 * 64 * 4 * 16)
        monkeypatch.setattr(routed_groups, "MAX_ROWS", 64)
    length = 16 if grouping == "one_group" else 96  # 96: some experts see more than 64 rows

    model = build("qwen3_moe")
    ids = token_ids(4, length, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[3, 4:] = 0
    ref = reference_layer0(model, ids, mask)
    calib = {"input_ids": ids, "attention_mask": mask}
    res = jgptq.quantize_moe(model, calib, method="rtn", bits=4, group_size=16, keep_hessians=True, progress=False,
                             batch_size=4)
    (h_up, n_up), (h_down, n_down) = (res.hessians[(0, ("mlp.experts", k))] for k in ("gate_up", "down"))
    assert n_up == n_down == [r[0] for r in ref]
    assert sum(n_up) == 2 * int(mask.sum())
    assert res.report.coverage["model.layers.0.mlp.experts"] == n_up
    for e, (n, hu, hd) in enumerate(ref):
        np.testing.assert_allclose(np.asarray(h_up[e]), hu, rtol=1e-5, atol=1e-6 * np.abs(hu).max())
        np.testing.assert_allclose(np.asarray(h_down[e]), hd, rtol=1e-4, atol=1e-5 * np.abs(hd).max())
    # padding excluded: the same sequences without padding, one at a time, give the same statistics
    seqs = [ids[b, : int(mask[b].sum())] for b in range(4)]
    one = jgptq.quantize_moe(build("qwen3_moe"), seqs, method="rtn", bits=4, group_size=16, keep_hessians=True,
                             progress=False, batch_size=1)
    for key, (h, n) in res.hessians.items():
        h1, n1 = one.hessians[key]
        assert n == n1, key
        np.testing.assert_allclose(np.asarray(h), np.asarray(h1), rtol=1e-4, atol=1e-6, err_msg=str(key))


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("weighting, power", [("linear", 1), ("squared", 2)])
def test_router_weighted_expert_hessians_equal_a_float64_reference(weighting, power, grouped, monkeypatch):
    import jgptq

    monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype: grouped)
    monkeypatch.setattr(routed_groups, "GROUP_BYTES", 64 * 64 * 4 * 3)    # several groups, experts in passes of 64
    monkeypatch.setattr(routed_groups, "MAX_ROWS", 64)
    ids = token_ids(4, 96, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    ref = reference_layer0(build("qwen3_moe"), ids, mask, power)
    calib = {"input_ids": ids, "attention_mask": mask}
    opts = {"method": "rtn", "bits": 4, "group_size": 16, "keep_hessians": True, "progress": False, "batch_size": 4}
    res = jgptq.quantize_moe(build("qwen3_moe"), calib, router_weighting=weighting, **opts)
    plain = jgptq.quantize_moe(build("qwen3_moe"), calib, **opts)
    (h_up, n_up), (h_down, n_down) = (res.hessians[(0, ("mlp.experts", k))] for k in ("gate_up", "down"))
    assert n_up == n_down == [r[0] for r in ref]                       # token counts stay unweighted
    for e, (n, hu, hd) in enumerate(ref):
        np.testing.assert_allclose(np.asarray(h_up[e]), hu, rtol=1e-5, atol=1e-6 * np.abs(hu).max())
        np.testing.assert_allclose(np.asarray(h_down[e]), hd, rtol=1e-4, atol=1e-5 * np.abs(hd).max())
    assert not np.allclose(np.asarray(h_up), np.asarray(plain.hessians[(0, ("mlp.experts", "gate_up"))][0]))
    for key, (h, n) in plain.hessians.items():                         # linear modules: unweighted
        if not isinstance(key[1], tuple):
            assert n == res.hessians[key][1] and np.array_equal(np.asarray(h), np.asarray(res.hessians[key][0]))
    for name, entry in plain.imatrix.items():                          # the importance statistic: unweighted
        np.testing.assert_allclose(res.imatrix[name].sums, entry.sums, rtol=1e-6, atol=0, err_msg=name)
        np.testing.assert_array_equal(res.imatrix[name].counts, entry.counts)


@pytest.mark.parametrize("accelerator", [False, True])
def test_group_layout_covers_each_expert_once_within_its_padding(accelerator):
    rng = np.random.default_rng(0)
    counts = [int(n) for n in rng.lognormal(7.5, 0.8, 128)]
    counts[5] = counts[9] = 0
    groups = routed_groups.group_layout(counts, 2048 * 2, accelerator)
    seen = [e for _, slots in groups for e in slots if e >= 0]
    assert sorted(seen) == [e for e, n in enumerate(counts) if n]
    sizes = {}
    for p, slots in groups:
        g = len(slots)
        assert g * p * 2048 * 2 <= routed_groups.GROUP_BYTES and g & (g - 1) == 0
        real = sum(e >= 0 for e in slots)
        assert g < 2 * real or accelerator       # on an accelerator: at least an eighth of the largest
        sizes.setdefault(p, set()).add(g)
        for e in slots:
            if e >= 0:
                n = min(counts[e], routed_groups.MAX_ROWS)
                assert n <= p and (p == 64 or p < 2 * n), (n, p)
    if accelerator:   # a few programs per row size
        assert all(len(s) <= 4 for s in sizes.values())
        assert all(min(s) >= max(s) // 8 for s in sizes.values())


def test_all_experts_mode_ties_gate_up_and_sees_every_token():
    import jgptq

    ids = token_ids(4, 16, seed=6)
    res = jgptq.quantize_moe(build("qwen3_moe"), ids, method="rtn", bits=4, group_size=16, keep_hessians=True,
                             calibration="all_experts", progress=False)
    h_up, n_up = res.hessians[(0, ("mlp.experts", "gate_up"))]
    h_down, n_down = res.hessians[(0, ("mlp.experts", "down"))]
    assert h_up.shape == (64, 64) and n_up == 64
    assert h_down.shape == (8, 32, 32) and n_down == [64] * 8
    cov = res.report.coverage["model.layers.0.mlp.experts"]
    assert sum(cov) == 2 * 64 and max(cov) < 64        # coverage still counts routed tokens


def test_shared_inputs_share_one_hessian():
    import jgptq

    res = jgptq.quantize_moe(build("deepseek_v3"), token_ids(2, 16, seed=7), method="rtn", bits=4, group_size=16,
                             progress=False)
    key = {r.name.split("layers.")[1]: r.hessian.split("layers.")[1] for r in res.report.records
           if r.kind == "linear"}
    assert key["0.self_attn.kv_a_proj_with_mqa"] == key["0.self_attn.q_a_proj"] == "0.self_attn.q_a_proj"
    assert key["0.mlp.up_proj"] == key["0.mlp.gate_proj"] == "0.mlp.gate_proj"
    assert key["1.mlp.shared_experts.up_proj"] == "1.mlp.shared_experts.gate_proj"
    assert key["0.self_attn.q_b_proj"] == "0.self_attn.q_b_proj" and key["0.self_attn.o_proj"] == "0.self_attn.o_proj"
    res = jgptq.quantize_moe(build("llama"), token_ids(2, 16, seed=7), method="rtn", bits=4, group_size=16,
                             progress=False)
    key = {r.name: r.hessian for r in res.report.records}
    assert key["model.layers.1.self_attn.k_proj"] == key["model.layers.1.self_attn.v_proj"] == \
        "model.layers.1.self_attn.q_proj"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_grouped_products_on_cuda_match_the_loop(monkeypatch):
    import jgptq

    model = build("qwen3_moe").to("cuda", torch.bfloat16)
    assert experts_capture._grouped_on(torch.device("cuda"), torch.bfloat16)
    ids = token_ids(4, 64, seed=7).cuda()
    capture._register()
    grouped = logits_with(model, ids, capture.IMPLEMENTATION).float()
    monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype: False)
    loop = logits_with(model, ids, capture.IMPLEMENTATION).float()
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2 * loop.abs().max().item())
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype, on=on: on)
        runs[on] = jgptq.quantize_moe(build("qwen3_moe").to("cuda", torch.bfloat16), ids.cpu(), method="rtn",
                                      bits=4, group_size=16, keep_hessians=True, progress=False, batch_size=4)
    for key, (h, n) in runs[True].hessians.items():
        h_loop, n_loop = runs[False].hessians[key]
        assert n == n_loop, key
        if isinstance(key[1], tuple):  # expert inputs: bf16 rows of either path, summed in float32
            np.testing.assert_allclose(np.asarray(h), np.asarray(h_loop), rtol=5e-2,
                                       atol=5e-2 * float(np.abs(np.asarray(h_loop)).max()), err_msg=str(key))


def test_expert_parallel_sentinels_add_nothing_in_both_paths(monkeypatch):
    # ids >= num_experts mark pairs routed to experts of another rank: both paths drop them (zero contribution)
    experts = build("qwen3_moe").model.layers[0].mlp.experts
    n_exp = int(experts.num_experts)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, experts.down_proj.shape[1], generator=g)
    index = torch.randint(0, n_exp, (10, 2), generator=g)
    weights = torch.rand(10, 2, generator=g)
    index[3, 1] = index[7, 0] = n_exp                  # two sentinel pairs
    kept = weights.clone()
    kept[3, 1] = kept[7, 0] = 0.0                       # the same pairs with zero weight, real ids
    plain_index = index.clone()
    plain_index[3, 1] = plain_index[7, 0] = 0
    outs = {}
    with torch.no_grad():
        for grouped in (False, True):
            monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype, on=grouped: on)
            outs[grouped] = experts_capture.experts_forward(experts, x, index, weights)
        monkeypatch.setattr(experts_capture, "_grouped_on", lambda device, dtype: False)
        reference = experts_capture.experts_forward(experts, x, plain_index, kept)
    torch.testing.assert_close(outs[True], reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[False], reference, rtol=0, atol=1e-6)


def test_gpt_oss_clamped_swiglu_where_the_clamp_acts():
    """gpt-oss clamps gate (above) and up (both sides) at swiglu_limit before its SwiGLU: with expert weights large
    enough that many pre-activations pass the limit, the capture implementation still computes the eager output."""
    model = build("gpt_oss")
    seen = []
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(50.0)
    experts = model.model.layers[0].mlp.experts
    hook = experts.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    ids = token_ids(2, 12, seed=3)
    eager = logits_with(model, ids, "eager")
    hook.remove()
    pre = torch.einsum("th,ehf->etf", seen[0], experts.gate_up_proj.detach()) + experts.gate_up_proj_bias[:, None]
    assert (pre[..., 0::2] > experts.limit).float().mean() > 0.1          # gate clamped above
    assert (pre[..., 1::2].abs() > experts.limit).float().mean() > 0.1    # up clamped on both sides
    capture._register()
    plain = logits_with(model, ids, capture.IMPLEMENTATION)
    torch.testing.assert_close(plain, eager, rtol=0, atol=2e-6 * float(eager.abs().max()))


def test_a_chunk_of_experts_is_not_padded_to_the_slots_of_the_whole_layer():
    """5 kept experts of 256 (a chunk): on an accelerator every group has at most 8 slots (the next power of two
    of the chunk), not the 32 the whole layer's slot floor gives at width 2048; the same experts covered."""
    counts = [0] * 256
    for e, n in zip(range(40, 45), (300, 500, 700, 90, 1200)):
        counts[e] = n
    groups = routed_groups.group_layout(counts, 2048 * 2, True, kept=5)
    assert max(len(slots) for _, slots in groups) <= 8
    assert sorted(e for _, slots in groups for e in slots if e >= 0) == list(range(40, 45))
    assert max(len(slots) for _, slots in routed_groups.group_layout(counts, 2048 * 2, True)) >= 32   # uncapped


def test_a_group_of_wide_experts_keeps_its_products_within_bounds():
    """At DeepSeek-V3's width (bf16 rows of 7168) a group has at most 16 slots (16 x 7168^2 x 4 B = 3.3 GB of
    products, within PRODUCT_BYTES), at Qwen3-235B-A22B's 4096 at most 64; at Qwen3-30B-A3B's 2048 the input
    bound (GROUP_BYTES) and the experts' count decide (256); every expert covered once."""
    rng = np.random.default_rng(1)
    for cols, most in ((7168, 16), (4096, 64), (2048, 256)):
        counts = [int(n) for n in rng.integers(400, 700, 256)]
        groups = routed_groups.group_layout(counts, cols * 2, True)
        assert max(len(s) for _, s in groups) == most, cols
        assert all(len(s) * cols * cols * 4 <= routed_groups.PRODUCT_BYTES for _, s in groups)
        assert sorted(e for _, s in groups for e in s if e >= 0) == list(range(256))


def test_narrow_experts_take_one_group_size_a_level_on_an_accelerator():
    """Where a level's padding slots cost little arithmetic (512-wide float32 rows, 8 experts: the quality model's),
    every accelerator group of the level has the level's most slots, so the accumulation compiles one program a
    level, not up to four; wide experts (2048 bf16 columns) keep the sizes an eighth of the most apart; the CPU
    layout is unchanged; each expert covered once."""
    rng = np.random.default_rng(3)
    sizes = {}   # rows per slot -> slot counts met over many forwards (each a program)
    for _ in range(50):
        counts = [int(n) for n in rng.integers(1, 3000, 8)]
        groups = routed_groups.group_layout(counts, 512 * 4, True)
        for p, slots in groups:
            sizes.setdefault(p, set()).add(len(slots))
        assert sorted(e for _, s in groups for e in s if e >= 0) == list(range(8))
        cpu = routed_groups.group_layout(counts, 512 * 4, False)
        assert all(len(s) < 2 * sum(e >= 0 for e in s) for _, s in cpu)    # the CPU pads to the next power of two
    assert {p: s for p, s in sizes.items() if p <= 2048} == {64 << i: {8} for i in range(6)}
    assert len(sizes[4096]) > 1
    wide = routed_groups.layout_shapes(128, 128, 2048 * 2, 8192, 8192 * 8)
    assert len({g for g, p in wide if p == 64}) == 4
