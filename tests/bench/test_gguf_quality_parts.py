"""The gguf_quality benchmark's own arithmetic: llama.cpp-style windowed KL against closed forms, the corpus split,
and the imatrix file as llama.cpp's quantize tool reads it."""

import math

import numpy as np
import pytest

from benchmarks.quality import corpus, kl


def test_two_token_kl_matches_the_closed_form():
    a = np.linspace(-6.0, 6.0, 41)
    b = a[::-1] * 0.7 + 0.3
    ref = np.stack([np.zeros_like(a), a], -1).astype(np.float32)
    q = np.stack([np.zeros_like(b), b], -1).astype(np.float32)
    p1 = 1.0 / (1.0 + np.exp(-a.astype(np.float32).astype(np.float64)))
    q1 = 1.0 / (1.0 + np.exp(-b.astype(np.float32).astype(np.float64)))
    want = p1 * np.log(p1 / q1) + (1 - p1) * np.log((1 - p1) / (1 - q1))
    got = kl.token_stats(ref, q, np.zeros(len(a), np.int64))
    np.testing.assert_allclose(got["kl"], want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got["nll_ref"], -np.log(1 - p1), rtol=1e-9)
    # a constant added to a row of logits changes no distribution
    shifted = kl.token_stats(ref.astype(np.float64) + 50.0, q.astype(np.float64) - 30.0, np.zeros(len(a), np.int64))
    np.testing.assert_allclose(shifted["kl"], want, rtol=1e-9, atol=1e-12)


def test_windows_score_only_the_second_half_against_the_next_token():
    rng = np.random.default_rng(0)
    n, n_ctx, vocab, c = 3, 16, 7, 4.0
    tokens = rng.integers(0, vocab, (n, n_ctx))
    first = kl.first_scored(n_ctx)
    assert first == 8 and kl.scored_slice(n_ctx) == slice(8, 15)
    ref = np.zeros((n, n_ctx, vocab), np.float32)          # uniform reference
    quant = np.zeros((n, n_ctx, vocab), np.float32)
    for i in range(n):
        for pos in range(n_ctx - 1):                         # logit c on the actual next token
            quant[i, pos, tokens[i, pos + 1]] = c
    ref[:, :first] = np.nan                                  # never read
    quant[:, :first] = np.nan
    stats = kl.window_stats(ref, quant, tokens)
    scored = n * (n_ctx - 1 - first)
    assert all(v.shape == (scored,) for v in stats.values())
    want_kl = -math.log(vocab) - c / vocab + math.log(math.exp(c) + vocab - 1)   # KL(uniform || q)
    np.testing.assert_allclose(stats["kl"], want_kl, rtol=1e-12)
    np.testing.assert_allclose(stats["nll"], math.log(math.exp(c) + vocab - 1) - c, rtol=1e-12)
    np.testing.assert_allclose(stats["nll_ref"], math.log(vocab), rtol=1e-12)
    targets = tokens[:, first + 1:].reshape(-1)
    np.testing.assert_array_equal(stats["same_top"], targets == 0)   # argmax of a uniform row is token 0
    summary = kl.summarize(stats)
    assert summary["tokens"] == scored
    assert summary["ppl_ref"] == pytest.approx(vocab, rel=1e-12)
    assert summary["kl_median"] == pytest.approx(want_kl, rel=1e-12)
    assert summary["same_top_rate"] == pytest.approx(np.mean(targets == 0))


def test_kl_is_zero_for_identical_models_and_summaries_rank_quantiles():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 8, 5)).astype(np.float32)
    tokens = rng.integers(0, 5, (2, 8))
    same = kl.summarize(kl.window_stats(logits, logits, tokens))
    assert same["kl_mean"] == 0.0 and same["same_top_rate"] == 1.0 and same["ln_ppl_ratio"] == 0.0
    s = kl.summarize({"kl": np.arange(101.0), "nll": np.zeros(101), "nll_ref": np.zeros(101),
                      "same_top": np.ones(101, bool)})
    assert (s["kl_mean"], s["kl_median"], s["kl_p99"], s["kl_max"]) == (50.0, 50.0, 99.0, 100.0)


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
