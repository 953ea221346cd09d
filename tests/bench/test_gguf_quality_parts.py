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
