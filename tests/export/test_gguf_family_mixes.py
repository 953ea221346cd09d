"""llama.cpp's own mixes (``llama_model_quantize`` with its per-tensor rules) on the F32 GGUF of a multi-head
latent attention model give the formats jgptq's plan gives the same weights: ``kv_b_proj``'s ``attn_v_b`` takes
the base type (llama.cpp's rules treat the split halves as any other weight); ``attn_k_b`` is left out (jgptq writes
it in the float type: a transpose no record's blocks survive)."""

import numpy as np
import pytest

from tests.export.family_models import build
from tests.export.gguf_models import flat_imatrix

pytestmark = pytest.mark.llama_cpp

WIDE = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=256, moe_intermediate_size=256, q_lora_rank=256, kv_lora_rank=256,
            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64)


@pytest.mark.parametrize("preset", ["q4_k_m", "q3_k_m"])
def test_deepseek2_mix_formats_match_llama_model_quantize(preset, tmp_path):
    pytest.importorskip("llama_cpp")
    from benchmarks.quality import llama_side
    from jgptq import PipelineConfig
    from jgptq_torch.export.gguf.arch import gguf_names
    from jgptq_torch.export.gguf.export import export_gguf
    from jgptq_torch import models
    from jgptq_torch.pipeline import run_setup

    model = build("deepseek_v3", **WIDE)
    src = str(tmp_path / "f32.gguf")
    export_gguf(model, None, src, float_type="f32")
    imatrix = flat_imatrix(src)
    dst = str(tmp_path / f"{preset}.gguf")
    llama_side.quantize(src, dst, preset, imatrix, keep_type="F32", threads=1)
    written = llama_side.tensor_types(dst)
    prefix, layers = models.find_decoder_layers(model)
    _, plan = run_setup.plan_layers(prefix, layers, PipelineConfig.build(None, mix=preset))
    names = gguf_names(model)
    compared = set()
    for param, matrix in plan.matrices.items():
        for gguf_name, _rows in names[param]:
            if ".attn_k_b." in gguf_name:
                continue
            assert written[gguf_name] == matrix.format.upper(), (gguf_name, param)
            compared.add(gguf_name.split(".", 2)[2])
    assert {"attn_v_b.weight", "attn_q_a.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight", "attn_output.weight",
            "ffn_down_exps.weight", "ffn_down_shexp.weight", "ffn_down.weight"} <= compared


def test_deepseek2_imatrix_is_accepted_by_llama_model_quantize(tmp_path):
    """An importance file from export_imatrix has, for attn_v_b, the kv_b_proj statistic once per head (llama.cpp
    checks ne0 x ne2 values and aborts on a mismatch) and no attn_k_b entry (another input); llama_model_quantize
    reads it (llama_side.read_imatrix) and quantizes q4_k_m with it."""
    pytest.importorskip("llama_cpp")
    from benchmarks.quality import llama_side
    from jgptq_torch.export.gguf.export import export_gguf, export_imatrix

    model = build("deepseek_v3", **WIDE)
    src = str(tmp_path / "f32.gguf")
    export_gguf(model, None, src, float_type="f32")
    rng = np.random.default_rng(0)
    stats = {}
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "embed" not in name and "lm_head" not in name and ".mlp.gate." not in name:
            experts = p.shape[0] if p.ndim == 3 else 1
            stats[name] = (rng.uniform(0.5, 2.0, (experts, p.shape[-1])).astype(np.float32),
                           np.full(experts, 10.0, np.float32))
    path = export_imatrix(model, stats, tmp_path / "imatrix.gguf")
    read = llama_side.read_imatrix(str(path))
    heads, lora = model.config.num_attention_heads, model.config.kv_lora_rank
    assert read["blk.1.attn_v_b.weight"].shape == (heads * lora,)
    assert "blk.1.attn_k_b.weight" not in read
    dst = str(tmp_path / "q4_k_m.gguf")
    llama_side.quantize(src, dst, "q4_k_m", read, keep_type="F32", threads=1)
    assert llama_side.tensor_types(dst)["blk.1.attn_v_b.weight"] == "Q4_K"
