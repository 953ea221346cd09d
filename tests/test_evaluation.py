"""jgptq.evaluation, the torch-free statistics of ``jgptq eval``: KL, top-1 and perplexity against closed forms and a
direct float64 computation, llama-perplexity's windows and scored positions, the table and the JSON."""

import json
import math
import statistics

import numpy as np
import pytest

from jgptq import evaluation as ev


def direct_kl(ref_row, row) -> float:
    """KL(softmax(ref_row) || softmax(row)) term by term in Python floats (an independent float64 reference)."""
    zr = math.fsum(math.exp(float(x)) for x in ref_row)
    zq = math.fsum(math.exp(float(x)) for x in row)
    return math.fsum(math.exp(float(a)) / zr * ((float(a) - math.log(zr)) - (float(b) - math.log(zq)))
                     for a, b in zip(ref_row, row))


def test_two_token_kl_matches_the_closed_form():
    a = np.linspace(-6.0, 6.0, 41)
    b = a[::-1] * 0.7 + 0.3
    ref = np.stack([np.zeros_like(a), a], -1).astype(np.float32)
    q = np.stack([np.zeros_like(b), b], -1).astype(np.float32)
    p1 = 1.0 / (1.0 + np.exp(-a.astype(np.float32).astype(np.float64)))
    q1 = 1.0 / (1.0 + np.exp(-b.astype(np.float32).astype(np.float64)))
    want = p1 * np.log(p1 / q1) + (1 - p1) * np.log((1 - p1) / (1 - q1))
    got = ev.token_stats(ref, q, np.zeros(len(a), np.int64))
    np.testing.assert_allclose(got["kl"], want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got["nll_ref"], -np.log(1 - p1), rtol=1e-9)
    # a constant added to a row of logits changes no distribution
    shifted = ev.token_stats(ref.astype(np.float64) + 50.0, q.astype(np.float64) - 30.0, np.zeros(len(a), np.int64))
    np.testing.assert_allclose(shifted["kl"], want, rtol=1e-9, atol=1e-12)


def test_statistics_equal_a_direct_float64_computation_across_row_chunks():
    rng = np.random.default_rng(3)
    rows, vocab = ev.ROWS_PER_CHUNK * 2 + 5, 11           # three chunks, the last one short
    ref = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    quant = (ref + rng.standard_normal((rows, vocab)) * 0.5).astype(np.float32)
    targets = rng.integers(0, vocab, rows)
    got = ev.token_stats(ref, quant, targets)
    want_kl = [direct_kl(r, q) for r, q in zip(ref, quant)]
    np.testing.assert_allclose(got["kl"], want_kl, rtol=1e-10, atol=1e-14)
    want_nll = [math.log(math.fsum(math.exp(float(x)) for x in q)) - float(q[t]) for q, t in zip(quant, targets)]
    np.testing.assert_allclose(got["nll"], want_nll, rtol=1e-10)
    np.testing.assert_array_equal(got["same_top"], [int(np.argmax(r)) == int(np.argmax(q)) for r, q in zip(ref, quant)])
    s = ev.summarize(got)
    assert s["tokens"] == rows
    assert s["kl_mean"] == pytest.approx(math.fsum(want_kl) / rows, rel=1e-10)
    assert s["kl_mean_stderr"] == pytest.approx(statistics.stdev(want_kl) / math.sqrt(rows), rel=1e-8)
    assert s["kl_median"] == pytest.approx(statistics.median(want_kl), rel=1e-10)
    cuts = statistics.quantiles(want_kl, n=100, method="inclusive")   # linear interpolation, as llama.cpp's
    assert (s["kl_p90"], s["kl_p99"]) == (pytest.approx(cuts[89], rel=1e-10), pytest.approx(cuts[98], rel=1e-10))
    assert s["kl_max"] == pytest.approx(max(want_kl), rel=1e-12)
    assert s["ppl"] == pytest.approx(math.exp(math.fsum(want_nll) / rows), rel=1e-10)
    rate = float(np.mean(got["same_top"]))
    assert s["same_top_stderr"] == pytest.approx(math.sqrt(rate * (1 - rate) / rows))


def test_windows_score_only_the_second_half_against_the_next_token():
    rng = np.random.default_rng(0)
    n, n_ctx, vocab, c = 3, 16, 7, 4.0
    tokens = rng.integers(0, vocab, (n, n_ctx))
    first = ev.first_scored(n_ctx)
    assert first == 8 and ev.scored_slice(n_ctx) == slice(8, 15)
    assert ev.scored_slice(17) == slice(8, 16)              # odd n_ctx: 8 scored tokens (positions 8..15)
    ref = np.zeros((n, n_ctx, vocab), np.float32)          # uniform reference
    quant = np.zeros((n, n_ctx, vocab), np.float32)
    for i in range(n):
        for pos in range(n_ctx - 1):                         # logit c on the actual next token
            quant[i, pos, tokens[i, pos + 1]] = c
    ref[:, :first] = np.nan                                  # never read
    quant[:, :first] = np.nan
    ref[:, -1] = quant[:, -1] = np.nan                       # the last position predicts nothing in the window
    stats = ev.window_stats(ref, quant, tokens)
    scored = n * (n_ctx - 1 - first)
    assert all(v.shape == (scored,) for v in stats.values())
    want_kl = -math.log(vocab) - c / vocab + math.log(math.exp(c) + vocab - 1)   # KL(uniform || q)
    np.testing.assert_allclose(stats["kl"], want_kl, rtol=1e-12)
    np.testing.assert_allclose(stats["nll"], math.log(math.exp(c) + vocab - 1) - c, rtol=1e-12)
    np.testing.assert_allclose(stats["nll_ref"], math.log(vocab), rtol=1e-12)
    targets = tokens[:, first + 1:].reshape(-1)
    np.testing.assert_array_equal(stats["same_top"], targets == 0)   # argmax of a uniform row is token 0
    summary = ev.summarize(stats)
    assert summary["tokens"] == scored
    assert summary["ppl_ref"] == pytest.approx(vocab, rel=1e-12)
    assert summary["kl_median"] == pytest.approx(want_kl, rel=1e-12)


def test_windows_are_cut_as_llama_perplexity_cuts_its_chunks():
    stream = np.arange(1, 44)                               # 43 tokens: two windows of 16, a tail of 11 dropped
    w = ev.cut_windows(stream, 16)
    assert w.dtype == np.int64 and w.shape == (2, 16)
    np.testing.assert_array_equal(w.reshape(-1), stream[:32])
    with_bos = ev.cut_windows(stream, 16, bos_id=0)        # each window's first token becomes BOS
    np.testing.assert_array_equal(with_bos[:, 0], [0, 0])
    np.testing.assert_array_equal(with_bos[:, 1:], w[:, 1:])
    np.testing.assert_array_equal(ev.cut_windows(stream, 16, limit=1), w[:1])
    with pytest.raises(ev.EvaluationError) as e:
        ev.cut_windows(stream, 64)
    assert str(e.value) == ("the text gives 43 tokens, fewer than one window of 64; give more text or a smaller "
                            "n_ctx")
    with pytest.raises(ev.EvaluationError) as e:
        ev.cut_windows(stream, 3)
    assert str(e.value) == "n_ctx: 3 must be at least 4 tokens"
    with pytest.raises(ev.EvaluationError) as e:
        ev.cut_windows(stream, 8, limit=0)
    assert str(e.value) == "windows: 0 must be at least 1 (or None for all)"


def test_identical_logits_give_zero_kl_and_quantiles_rank():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 8, 5)).astype(np.float32)
    tokens = rng.integers(0, 5, (2, 8))
    same = ev.summarize(ev.window_stats(logits, logits, tokens))
    assert same["kl_mean"] == 0.0 and same["kl_max"] == 0.0 and same["same_top_rate"] == 1.0
    assert same["ln_ppl_ratio"] == 0.0 and same["ppl"] == same["ppl_ref"]
    s = ev.summarize({"kl": np.arange(101.0), "nll": np.zeros(101), "nll_ref": np.zeros(101),
                      "same_top": np.ones(101, bool)})
    assert (s["kl_mean"], s["kl_median"], s["kl_p90"], s["kl_p99"], s["kl_max"]) == (50.0, 50.0, 90.0, 99.0, 100.0)


def test_the_held_out_demo_text_is_the_part_the_demo_does_not_calibrate_on():
    calib, held = ev.demo_texts()
    whole = (ev.__file__.rsplit("/", 1)[0] + "/data/calibration.txt")
    text = open(whole, encoding="utf-8").read()
    assert text.startswith(calib) and text.rstrip().endswith(held) and held not in calib
    assert 0.1 < len(held) / len(text) < 0.3


def evaluation(**summary) -> ev.Evaluation:
    base = {"tokens": 1386, "kl_mean": 0.0107665, "kl_mean_stderr": 6.07e-05, "kl_median": 0.0104886,
            "kl_p90": 0.0139213, "kl_p99": 0.0157401, "kl_max": 0.0178257, "same_top_rate": 0.1349206,
            "same_top_stderr": 0.0091767, "ppl": 250.00632, "ppl_ref": 259.10969, "ln_ppl_ratio": -0.0357653}
    return ev.Evaluation(summary={**base, **summary}, per_token={}, quantized="q.gguf", reference="float",
                         runtimes={"quantized": "llama.cpp", "reference": "torch on cpu"}, text="held.txt",
                         n_ctx=128, windows=22, notes=("runtimes differ",))


def test_table_and_json(tmp_path):
    assert evaluation().table().splitlines() == [
        "quantized: q.gguf, run in llama.cpp",
        "float:     float, run in torch on cpu",
        "text:      held.txt; 22 windows of 128 tokens, positions 64..126 of each scored",
        "",
        "tokens scored         1386",
        "KL mean               1.0767e-02 ± 6.1e-05",
        "KL median             1.0489e-02",
        "KL p90                1.3921e-02",
        "KL p99                1.5740e-02",
        "KL max                1.7826e-02",
        "top-1 agreement       13.49% ± 0.92%",
        "perplexity quantized  250.0063",
        "perplexity float      259.1097",
        "note: runtimes differ"]
    one = evaluation(tokens=1, kl_mean_stderr=float("nan"))
    one.to_json(tmp_path / "e.json")
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["summary"]["kl_mean_stderr"] is None and data["summary"]["tokens"] == 1
    assert (data["n_ctx"], data["windows"], data["first_scored"], data["scored_per_window"]) == (128, 22, 64, 63)
    assert data["runtimes"] == {"quantized": "llama.cpp", "reference": "torch on cpu"}
    assert data["notes"] == ["runtimes differ"]
