"""Linear-attention models: the slow-kernel warning is given on GPU runs without the fla kernels, never on CPU."""

import warnings

import pytest
import torch

from jgptq_torch import linear_attention as models

transformers = pytest.importorskip("transformers")


def tiny_qwen3_next():
    cfg = transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_linear_attention_layers_are_found_and_the_warning_names_the_fix(monkeypatch):
    model = tiny_qwen3_next()
    names = models.linear_attention_modules(model)
    assert names and all("DeltaNet" in n for n in names)
    assert models.slow_linear_attention(model, "cpu") is None  # the fast kernels are GPU-only
    import transformers.utils.import_utils as iu

    monkeypatch.setattr(iu, "is_flash_linear_attention_available", lambda: False)
    message = models.slow_linear_attention(model, "cuda")
    assert message and "pip install fla-core" in message and names[0] in message
    monkeypatch.setattr(iu, "is_flash_linear_attention_available", lambda: True)
    assert models.slow_linear_attention(model, "cuda") is None


def test_softmax_attention_models_get_no_warning():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   intermediate_size=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert models.linear_attention_modules(model) == []
    assert models.slow_linear_attention(model, "cuda") is None


def test_quantize_moe_says_it_once_before_calibrating(monkeypatch):
    """A GPU run without the kernels is simulated by the check itself; the pipeline must warn once, up front."""
    import jgptq

    model = tiny_qwen3_next()
    calls = []
    monkeypatch.setattr(models, "slow_linear_attention",
                        lambda m, d: calls.append(str(d)) or "slow linear-attention kernels: pip install fla-core")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = jgptq.quantize_moe(model, ids, bits=4, group_size=16, progress=False)
    assert calls == ["cpu"]
    assert len([w for w in caught if "fla-core" in str(w.message)]) == 1
    assert any("fla-core" in w for w in result.report.warnings)
    # the linear-attention mixer's projections are quantized; its short convolution stays in floating point
    assert any(n.endswith("linear_attn.conv1d") for n, _ in result.report.skipped)
    assert any("linear_attn" in k for k in result.weights)
