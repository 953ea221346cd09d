"""``jgptq eval`` end to end on a tiny model (the exact table it prints, the JSON it writes) and its refusals of
bad input, each one line."""

import json
import math
import sys

import numpy as np
import pytest

from jgptq_torch.cli.main import main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY = dict(hidden_size=64, head_dim=16, moe_intermediate_size=32, intermediate_size=128)
TEXT = "Held-out prose for the command line: the quick brown fox jumps over the lazy dog, twice over. " * 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A float tiny Qwen3-MoE folder with a byte tokenizer, a copy with perturbed weights (no tokenizer), and a
    text file."""
    from jgptq_torch.cli.demo import byte_tokenizer, tiny_moe

    root = tmp_path_factory.mktemp("evalcli")
    model = tiny_moe(1, 0, **TINY)
    model.save_pretrained(root / "float")
    byte_tokenizer().save_pretrained(root / "float")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(root / "noisy")
    (root / "held.txt").write_text(TEXT, encoding="utf-8")
    return root


def expected_lines(root, n_ctx: int) -> list:
    """The table, from a direct float64 computation in torch (byte tokenizer: token ids are the text's bytes)."""
    from transformers import AutoModelForCausalLM

    data = np.frombuffer(TEXT.encode(), np.uint8).astype(np.int64)
    n, first = data.size // n_ctx, n_ctx // 2
    ids = torch.from_numpy(data[: n * n_ctx].reshape(n, n_ctx))
    with torch.no_grad():
        lf = torch.log_softmax(AutoModelForCausalLM.from_pretrained(root / "float")(ids).logits.double(), -1)
        lq = torch.log_softmax(AutoModelForCausalLM.from_pretrained(root / "noisy")(ids).logits.double(), -1)
    lf, lq = lf[:, first:-1], lq[:, first:-1]
    kl = (lf.exp() * (lf - lq)).sum(-1).reshape(-1).numpy()
    target = ids[:, first + 1:, None]
    nll, nll_ref = -lq.gather(-1, target).mean().item(), -lf.gather(-1, target).mean().item()
    top = (lf.argmax(-1) == lq.argmax(-1)).double().mean().item()
    t = kl.size
    return [f"quantized: {root / 'noisy'}, run in torch on cpu",
            f"float:     {root / 'float'}, run in torch on cpu",
            f"text:      {root / 'held.txt'}; {n} windows of {n_ctx} tokens, positions {first}..{n_ctx - 2} of each "
            f"scored",
            "",
            f"tokens scored         {t}",
            f"KL mean               {kl.mean():.4e} ± {kl.std(ddof=1) / math.sqrt(t):.1e}",
            f"KL median             {np.median(kl):.4e}",
            f"KL p90                {np.quantile(kl, 0.9):.4e}",
            f"KL p99                {np.quantile(kl, 0.99):.4e}",
            f"KL max                {kl.max():.4e}",
            f"top-1 agreement       {top:.2%} ± {math.sqrt(top * (1 - top) / t):.2%}",
            f"perplexity quantized  {math.exp(nll):.4f}",
            f"perplexity float      {math.exp(nll_ref):.4f}"]


def test_eval_prints_the_table_and_writes_json(folders, capsys):
    out = folders / "eval.json"
    args = ["eval", folders / "noisy", "--float", folders / "float", "--text", folders / "held.txt", "--n-ctx", 64,
            "--json", out, "--quiet", "--device", "cpu"]
    assert main([str(a) for a in args]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == expected_lines(folders, 64) + [f"wrote {out}"]
    assert captured.err == ""
    data = json.loads(out.read_text())
    assert data["summary"]["tokens"] == (len(TEXT) // 64) * 31 and data["first_scored"] == 32
    assert data["quantized"] == str(folders / "noisy") and data["notes"] == []
    assert data["summary"]["kl_mean"] > 0


def refused(capsys, *args) -> str:
    assert main([str(a) for a in args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("jgptq: error: ") and err.count("\n") == 1, err
    return err.strip()


def test_bad_input_is_refused_in_one_line(folders, capsys, monkeypatch):
    q, f = folders / "noisy", folders / "float"
    assert refused(capsys, "eval", q, "--float", f, "--n-ctx", 3) == (
        "jgptq: error: --n-ctx 3: windows need at least 4 tokens (default: 512)")
    assert refused(capsys, "eval", q, "--float", f, "--windows", 0) == "jgptq: error: --windows 0: must be at least 1"
    assert refused(capsys, "eval", folders / "nothing", "--float", f) == (
        f"jgptq: error: quantized model '{folders / 'nothing'}' does not exist")
    assert refused(capsys, "eval", q, "--float", f, "--text", folders / "none.txt") == (
        f"jgptq: error: evaluation text '{folders / 'none.txt'}' does not exist")
    assert refused(capsys, "eval", q, "--float", f, "--text", folders / "held.txt", "--n-ctx", 4096) == (
        f"jgptq: error: the text gives {len(TEXT)} tokens, fewer than one window of 4096; give more text or a "
        f"smaller n_ctx")
    assert refused(capsys, "eval", q, "--float", f, "--json", folders / "no" / "e.json") == (
        f"jgptq: error: --json {folders / 'no' / 'e.json'}: the folder '{folders / 'no'}' does not exist")
    gguf = folders / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)   # the package cannot be imported
    assert refused(capsys, "eval", gguf, "--float", f) == (
        f"jgptq: error: {gguf}: GGUF files run in llama.cpp, which needs the llama_cpp package (ModuleNotFoundError: "
        f"import of llama_cpp halted; None in sys.modules); install it with: pip install llama-cpp-python")
