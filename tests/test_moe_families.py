"""Every MoE family of the tiny test models: quantize_moe runs (round-to-nearest on one short calibration, every
target on its grid, every routed expert's tokens seen). Refusals: ``tests/test_moe_refusals.py``."""

import pytest

import jgptq
from tests.tiny_models import FAMILIES, build, token_ids

CALIB = token_ids(2, 16, seed=1)
MOE = sorted(f for f in FAMILIES if f != "llama")
RUN = {"method": "rtn", "bits": 4, "group_size": 16, "batch_size": 2, "progress": False}


def _top_k(config) -> int:
    """Experts per token, under whichever name the family's config gives it."""
    names = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k_experts")
    ffn = getattr(config, "ffn_config", None)                           # DBRX keeps it in its FFN's config
    return next(getattr(c, n) for c, n in [(config, n) for n in names] + [(ffn, "moe_top_k")]
                if isinstance(getattr(c, n, None), int))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", MOE)
def test_quantize_moe_runs_on_every_moe_family(family):
    model = build(family)
    result = jgptq.quantize_moe(model, CALIB, **RUN)
    assert result.report.coverage, family                              # at least one MoE layer seen
    for name, counts in result.report.coverage.items():
        assert sum(counts) == _top_k(model.config) * CALIB.numel(), name
    assert any(r.kind == "expert_gate_up" for r in result.report.records)
    assert not _routers(model) & set(result.weights), family                # routers stay in floating point


def _routers(model) -> set:
    """The parameters the GGUF exporter's plan (from the gguf package's name maps) calls routers."""
    from jgptq_torch.export.gguf.arch import UnsupportedGGUFModel, arch_of, targets

    try:
        plan = targets(model, arch_of(model))
    except UnsupportedGGUFModel:
        return set()
    return {p for p, ts in plan.items() if any(t.role == "router" for t in ts)}
