"""The gguf_quality benchmark's own parts: the corpus split, and the imatrix file as llama.cpp's quantize tool reads
it (the windowed KL is the library's, tested in tests/test_evaluation.py)."""

import numpy as np
import pytest

from benchmarks.quality import corpus


def test_corpus_split_is_disjoint_covering_and_deterministic():
    data = corpus.corpus_bytes()
    assert data == corpus.corpus_bytes() and len(data) > 100_000
    s = corpus.split(data, piece=8192)
    spans = sorted(r for rs in s.ranges.values() for r in rs)
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))           # no gap, no overlap
    for name, rs in s.ranges.items():
        assert bytes(s.tokens[name]) == b"".join(data[a:b] for a, b in rs)
    starts = {name: {a for a, _ in rs} for name, rs in s.ranges.items()}
    assert not (starts["train"] & starts["heldout"]) and not (starts["calib"] & starts["heldout"])
    assert not (starts["train"] & starts["calib"])
    assert [corpus.split_of_piece(i) for i in range(10)] == ["train"] * 3 + ["calib"] + ["train"] * 3 + \
        ["heldout"] + ["train"] * 2
    w = corpus.windows(s.tokens["heldout"], 256)
    assert w.dtype == np.int64 and w.shape[1] == 256 and w.max() < corpus.VOCAB
    np.testing.assert_array_equal(w.reshape(-1), s.tokens["heldout"][: w.size])
    with pytest.raises(ValueError, match="piece"):
        corpus.split(data, piece=0)


def test_imatrix_file_reads_as_llama_quantize_divides_it(tmp_path):
    imatrix = pytest.importorskip("jgptq.imatrix")
    pytest.importorskip("gguf")
    from benchmarks.quality.llama_side import read_imatrix

    rng = np.random.default_rng(2)
    sums = rng.uniform(0, 10, (4, 256)).astype(np.float32)
    counts = np.array([3, 0, 7, 1], np.float32)                 # an expert that saw no token
    dense = rng.uniform(0, 10, (1, 512)).astype(np.float32)
    path = imatrix.write_imatrix(tmp_path / "m.gguf", {"blk.0.ffn_up_exps.weight": (sums, counts),
                                                       "blk.0.attn_q.weight": (dense, np.array([5], np.float32))})
    got = read_imatrix(str(path))
    want = sums / np.maximum(counts, 1)[:, None]
    want[1] = 1.0
    np.testing.assert_array_equal(got["blk.0.ffn_up_exps.weight"], want.reshape(-1))
    np.testing.assert_array_equal(got["blk.0.attn_q.weight"], (dense / np.float32(5)).reshape(-1))


def test_arch_option_picks_the_model_formats_and_results_file():
    from benchmarks import gguf_quality

    plain = gguf_quality._args([])
    assert plain.model == "quality" and plain.formats == "q4_k,iq4_xs,iq3_xxs,iq2_xxs,iq1_s"
    assert plain.out.endswith("results/gguf_quality.json")
    oss = gguf_quality._args(["--arch", "gpt_oss"])
    assert oss.model == "gpt_oss" and oss.out.endswith("results/gguf_quality_gpt_oss.json")
    assert "mxfp4_moe" in oss.formats.split(",") and "q4_k_m" in oss.formats.split(",")
    ds = gguf_quality._args(["--arch", "deepseek_v3", "--small", "--out", "x.json"])
    assert ds.model == "deepseek_v3" and ds.out == "x.json" and ds.formats == "q4_k_m" and ds.windows == 8


def test_family_models_build_load_and_keep_rows_two_blocks_long(tmp_path):
    torch = pytest.importorskip("torch")
    from benchmarks.quality import lm

    # the quality model's cache folder is unchanged by the family key (its weights are not retrained)
    assert lm.cache_key(lm.ARCH, lm.TRAIN, "x") == "962ffeaeab7bee8e"
    for name, cls in (("deepseek_v3", "DeepseekV3ForCausalLM"), ("gpt_oss", "GptOssForCausalLM")):
        arch, _ = lm.MODELS[name]
        model = lm.build(arch)
        assert type(model).__name__ == cls and not hasattr(model.config, "family")
        for param, p in model.named_parameters():     # every weight a quantizer sees: rows of >= 2 super-blocks
            if p.ndim >= 2 and "embed" not in param and "lm_head" not in param and "router" not in param \
                    and not param.endswith("_bias") \
                    and not param.endswith("mlp.gate.weight"):
                # gpt-oss stores its experts (E, in, out), the rest (..., out, in)
                rows = p.shape[-2] if ".experts." in param and name == "gpt_oss" else p.shape[-1]
                assert rows % 256 == 0 and rows >= 512, (name, param, tuple(p.shape))
        small = dict(arch, hidden_size=64, num_hidden_layers=2, q_lora_rank=32, kv_lora_rank=32,
                     intermediate_size=64, moe_intermediate_size=32) if name == "deepseek_v3" else \
            dict(arch, hidden_size=64, head_dim=16, intermediate_size=32, num_local_experts=4)
        model = lm.build(small)
        model.save_pretrained(tmp_path / name)
        again = lm.load(str(tmp_path / name), small)
        assert type(again) is type(model) and not again.training
        for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_keep_float_overrides_name_only_float_attn_k_b():
    from benchmarks.quality.gguf_run import keep_float_overrides

    types = {"blk.1.attn_k_b.weight": "F32", "blk.1.attn_v_b.weight": "Q4_K", "token_embd.weight": "F32"}
    assert keep_float_overrides(types) == {r"\.attn_k_b\.weight$": "F32"}
    assert keep_float_overrides(dict(types, **{"blk.1.attn_k_b.weight": "Q5_0"})) == {}
    assert keep_float_overrides({"blk.0.attn_q.weight": "Q4_K"}) == {}
