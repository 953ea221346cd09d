"""Source formats beyond the first cases: a DeepSeek-V3 FP8 folder read layer by layer, fused 3-D FP8 weights,
pack-quantized widths that straddle int32 words and the channel strategy, config groups, and CUDA tensors."""

import json

import pytest
import torch

from jgptq_torch.source import PackScheme, SourceFormat, companions, dequantize_tensors, source_format
from jgptq_torch.source.formats import pack_scheme
from tests.source.quantized_folders import (read_checkpoint, write_fp8_folder, write_mxfp4_folder,
                                            write_pack_quantized_folder)
from tests.source.test_dequant_fp8 import FP8, fp8_subset, read_folder, reference_fp8, tiny_qwen3_moe
from tests.source.test_dequant_mxfp4 import tiny_gpt_oss
from tests.source.test_dequant_packed import check_against_reference


def tiny_deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=192, intermediate_size=160, moe_intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=3,
                           n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=96,
                           kv_lora_rank=144, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_group=1,
                           topk_group=1)
    torch.manual_seed(5)
    return DeepseekV3ForCausalLM(cfg)


def test_deepseek_v3_fp8_read_layer_by_layer(tmp_path):
    """DeepSeek-V3's names (MLA projections, shared experts, a dense first layer, the router's score bias);
    kv_a_proj_with_mqa has 176 rows (144 + 32), a ragged second block like the real model's 576."""
    write_fp8_folder(tiny_deepseek_v3(), str(tmp_path))
    config, tensors = read_folder(str(tmp_path))
    fmt = source_format(config)
    assert tuple(tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape) == (2, 2)
    available = set(tensors)
    quantized = 0
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        names = {n for n in tensors if n.startswith(prefix) and not n.endswith("_scale_inv")}
        subset = {m: tensors[m] for n in names for m in [n, *companions(n, fmt, available)]}
        out = dequantize_tensors(subset, fmt, torch.float32)
        assert set(out) == names
        for name in names:
            if tensors[name].dtype == torch.float8_e4m3fn:
                ref = torch.from_numpy(reference_fp8(tensors[name], tensors[name + "_scale_inv"]))
                assert torch.equal(out[name], ref), name
                quantized += 1
            else:
                assert torch.equal(out[name], tensors[name]), name
    assert quantized == 5 + 3 + (5 + 3 * 3 + 3)  # MLA x5, dense MLP; MLA x5, 3 experts, shared expert


def test_sharded_fp8_folder_reads_like_one_file(tmp_path):
    """Four shards cut in name order, so some weights and their scales sit in different files; transformers
    loads the sharded folder through its index to the same weights."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    one, sharded = str(tmp_path / "one"), str(tmp_path / "sharded")
    write_fp8_folder(tiny_qwen3_moe(128, 64, seed=6), one)
    write_fp8_folder(tiny_qwen3_moe(128, 64, seed=6), sharded, shards=4)
    with open(f"{sharded}/model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) == 4
    assert any(weight_map[n] != weight_map[n + "_scale_inv"] for n in weight_map if n + "_scale_inv" in weight_map)
    config, tensors = read_checkpoint(sharded)
    assert set(tensors) == set(weight_map)
    ours = dequantize_tensors(tensors, source_format(config), torch.float32)
    reference = dequantize_tensors(read_checkpoint(one)[1], source_format(config), torch.float32)
    assert set(ours) == set(reference) and all(torch.equal(ours[k], reference[k]) for k in ours)
    hf = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True))
    state = hf.state_dict()
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
        assert torch.equal(state[name], ours[name]), name


def test_fp8_fused_3d_weight_is_each_slice():
    fmt = source_format(FP8)
    a, b = fp8_subset(), fp8_subset()
    b["m.layers.0.proj.weight_scale_inv"] = b["m.layers.0.proj.weight_scale_inv"] * 3
    fused = {"e.weight": torch.stack([a["m.layers.0.proj.weight"], b["m.layers.0.proj.weight"]]),
             "e.weight_scale_inv": torch.stack([a["m.layers.0.proj.weight_scale_inv"],
                                                b["m.layers.0.proj.weight_scale_inv"]])}
    out = dequantize_tensors(fused, fmt, torch.float32)["e.weight"]
    for i, part in enumerate((a, b)):
        ref = reference_fp8(part["m.layers.0.proj.weight"], part["m.layers.0.proj.weight_scale_inv"])
        assert torch.equal(out[i], torch.from_numpy(ref))


@pytest.mark.parametrize("bits, group_size", [(8, None), (3, 32), (2, 16)])
def test_pack_quantized_widths_and_channel_strategy(tmp_path, bits, group_size):
    """3 bits straddle int32 words (32 values in 3 words); 8 bits per output channel; 2 bits, groups of 16."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(bits)
    write_pack_quantized_folder(transformers.LlamaForCausalLM(cfg), str(tmp_path), num_bits=bits,
                                group_size=group_size)
    config, tensors = read_folder(str(tmp_path))
    fmt = source_format(config)
    assert fmt.schemes[0].strategy == ("channel" if group_size is None else "group")
    assert tensors["model.layers.0.mlp.down_proj.weight_packed"].shape == (64, -(-96 * bits // 32))
    out = dequantize_tensors(tensors, fmt, torch.float32)
    assert check_against_reference(tensors, out, bits, True) == 7


def test_pack_scheme_picks_the_group_by_target():
    wide = PackScheme(("re:.*self_attn.*",), 8, True, "channel", None)
    narrow = PackScheme(("Linear",), 4, True, "group", 32)
    fmt = SourceFormat("pack_quantized", schemes=(narrow, wide))
    assert pack_scheme(fmt, "model.layers.0.self_attn.q_proj") is wide
    assert pack_scheme(fmt, "model.layers.0.mlp.experts.3.up_proj") is narrow
    clash = SourceFormat("pack_quantized", schemes=(wide, PackScheme(("re:.*q_proj",), 4, True, "group", 32)))
    with pytest.raises(ValueError, match=r"2 config_groups of quantization_config apply to module "
                                         r"'model\.layers\.0\.self_attn\.q_proj'; exactly one must"):
        pack_scheme(clash, "model.layers.0.self_attn.q_proj")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_dequantize_on_the_device_as_on_cpu(tmp_path):
    writers = [(write_fp8_folder, tiny_qwen3_moe(192, 160)), (write_mxfp4_folder, tiny_gpt_oss()),
               (write_pack_quantized_folder, tiny_qwen3_moe(128, 64))]
    for i, (write, model) in enumerate(writers):
        path = str(tmp_path / str(i))
        write(model, path)
        config, tensors = read_folder(path)
        fmt = source_format(config)
        cpu = dequantize_tensors(tensors, fmt, torch.bfloat16)
        gpu = dequantize_tensors({k: v.cuda() for k, v in tensors.items()}, fmt, torch.bfloat16)
        assert set(cpu) == set(gpu)
        for name in cpu:
            assert gpu[name].device.type == "cuda", name
            assert torch.equal(gpu[name].cpu(), cpu[name]), name
