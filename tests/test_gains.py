"""jgptq_torch.pipeline.gains: the Fisher gain of each matrix against gradients taken by plain torch autograd on every
intermediate output (an experts forward written out here, expert by expert, with retain_grad)."""

import numpy as np
import pytest
import torch
from torch import nn

from jgptq_torch.pipeline.calib import Batch
from jgptq_torch.pipeline.gains import draw_labels, fisher_gains
from tests.tiny_models import build, token_ids


def reference_gains(model, ids, seed=0):
    """Mean squared gradient of the log-likelihood of labels drawn from the model, per output entry, by autograd."""
    layer = model.model.layers[0]
    experts = layer.mlp.experts
    kept = {"q": [], "gu": {}, "y": {}}

    def q_hook(mod, args, out):
        out.retain_grad()
        kept["q"].append(out)

    def experts_forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(experts.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if not len(tok):
                continue
            gu = nn.functional.linear(hidden[tok], experts.gate_up_proj[e])
            gu.retain_grad()
            gate, up = gu.chunk(2, dim=-1)
            y = nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])
            y.retain_grad()
            kept["gu"][e], kept["y"][e] = gu, y
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out

    handle = layer.self_attn.q_proj.register_forward_hook(q_hook)
    experts.forward = experts_forward
    try:
        logits = model(input_ids=ids, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1).reshape(-1, logits.shape[-1])
        labels = draw_labels(logits.reshape(-1, logits.shape[-1]), torch.Generator().manual_seed(seed))  # the pass's
        (-logp.gather(1, labels[:, None]).sum()).backward()
    finally:
        handle.remove()
        del experts.forward
    def mean_sq(t):
        return float((t.grad.double() ** 2).mean())

    return (mean_sq(kept["q"][0]), [mean_sq(kept["gu"][e]) if e in kept["gu"] else 0.0 for e in range(8)],
            [mean_sq(kept["y"][e]) if e in kept["y"] else 0.0 for e in range(8)])


def test_fisher_gains_are_the_mean_squared_output_gradients():
    model = build("qwen3_moe", seed=2)
    ids = token_ids(3, 16, seed=4)
    got = fisher_gains(model, [Batch(ids, torch.ones_like(ids))])
    q, gate_up, down = reference_gains(model, ids)
    np.testing.assert_allclose(got["model.layers.0.self_attn.q_proj.weight"], [q], rtol=1e-4)
    np.testing.assert_allclose(got["model.layers.0.mlp.experts.gate_up_proj"], gate_up, rtol=1e-4)
    np.testing.assert_allclose(got["model.layers.0.mlp.experts.down_proj"], down, rtol=1e-4)
    assert all(p.requires_grad for p in model.parameters())    # parameters are left as they were
    assert set(got) == {n for n, _ in model.named_parameters() if ".layers." in n and
                        ("proj" in n) and "norm" not in n}


def test_padding_is_left_out_of_the_gains():
    model = build("qwen3_moe", seed=2)
    ids = token_ids(2, 16, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    short = fisher_gains(model, [Batch(ids[:1], mask[:1])])
    both = fisher_gains(model, [Batch(ids, mask)])
    assert not np.allclose(short["model.layers.1.self_attn.o_proj.weight"],
                           both["model.layers.1.self_attn.o_proj.weight"])
    assert all(np.all(np.isfinite(v)) and np.all(v >= 0) for v in both.values())


def test_target_bpw_takes_its_gains_from_the_first_half_of_the_calibration_batches(monkeypatch):
    import jgptq
    from jgptq_torch.pipeline import gains, sensitivity

    batches = [object() for _ in range(5)]
    assert [len(sensitivity.gain_batches(batches[:n])) for n in range(1, 6)] == [1, 1, 2, 2, 3]
    assert sensitivity.gain_batches(batches) == batches[:3]
    seen = []

    class Stop(Exception):
        pass

    def watch(model, batch_list, **kw):
        seen.append([b.input_ids.clone() for b in batch_list])
        raise Stop

    monkeypatch.setattr(gains, "fisher_gains", watch)   # the first pass imports it from the module when it runs
    ids = token_ids(6, 16, seed=3)
    with pytest.raises(Stop):
        jgptq.quantize_moe(build("qwen3_moe", seed=2), ids, batch_size=2, progress=False, format="q8_0",
                           target_bpw=6.0, target_formats=("q4_0", "q8_0"))
    assert len(seen) == 1 and len(seen[0]) == 2   # 3 batches of 2 sequences: the first 2
    assert torch.equal(torch.cat(seen[0]), ids[:4])
