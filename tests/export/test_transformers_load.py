"""End to end: transformers loads a compressed-tensors export of a tiny Qwen3-MoE, fuses the per-expert tensors,
and holds exactly the solved weights."""

import numpy as np
import pytest

from jgptq.export import export_compressed_tensors
from tests.export.conftest import config, solved_experts

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_qwen3_moe_loads_with_solved_weights(tmp_path):
    from transformers.utils.quantization_config import CompressedTensorsConfig

    hf_config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=64, num_experts=2, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=32,
        tie_word_embeddings=False, dtype="float16")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).to(torch.float16)
    dense = {k: v.detach().numpy() for k, v in model.state_dict().items()}

    cfg = config()
    result, stack = solved_experts(cfg)  # seven solved 64 x 64 weights stand in for the layer's projections
    solved = np.asarray(result.weight)
    layer = "model.layers.0."
    quantized, want = {}, {}
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
        quantized[f"{layer}self_attn.{proj}"], want[f"{layer}self_attn.{proj}.weight"] = stack[i], solved[i]
    for e in range(2):
        for j, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            k = 4 + (j + e) % 3
            quantized[f"{layer}mlp.experts.{e}.{proj}"] = stack[k]
        gate, up, down = (solved[4 + (j + e) % 3] for j in range(3))
        want.setdefault(f"{layer}mlp.experts.gate_up_proj", []).append(np.concatenate([gate, up]))
        want.setdefault(f"{layer}mlp.experts.down_proj", []).append(down)
    unquantized = {k: v for k, v in dense.items() if "_proj" not in k}
    assert f"{layer}mlp.gate.weight" in unquantized and "lm_head.weight" in unquantized

    export_compressed_tensors(tmp_path / "m", quantized, tensors=unquantized, model_config=hf_config.to_dict(),
                              quant_config=cfg, ignore=["lm_head", "re:.*mlp.gate$"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", quantization_config=CompressedTensorsConfig(dequantize=True))
    state = {k: v.detach().numpy() for k, v in loaded.state_dict().items()}
    assert set(state) == set(dense)
    for name, w in want.items():
        w = np.stack(w) if isinstance(w, list) else w
        # transformers dequantizes in the scale dtype: float16 of the exact float32 products
        assert np.array_equal(state[name], w.astype(np.float16)), name
    for name, w in unquantized.items():
        assert np.array_equal(state[name], w), name
