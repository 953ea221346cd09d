"""GGUF tokenizer metadata: byte-level BPE vocabularies that llama.cpp tokenizes exactly as transformers does."""

import functools

import gguf
import pytest

from jgptq_torch.export.gguf.export import export_gguf
from jgptq_torch.export.gguf.vocab import SPLIT_PATTERNS, vocab_metadata
from tests.tiny_models import build

tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["Hello world, it's 2026!", "numbers 1234567 and 2026", "  leading spaces and\ttabs\n\nnew lines  ", "values 3.14159 and 1000000",
         "naïve café — ünïcödé ∑ 漢字 and emoji 🙂", "can't won't they'll I'd we've", "CAPS'LL x'S",
         "a<|endoftext|>b", "def f(x):\n    return x ** 2  # ok\r\n"]
PATTERNS = {name: pattern for pattern, name in SPLIT_PATTERNS.items()}


def corpus():
    import pydoc_data.topics as topics

    return list(topics.topics.values())[:150] + TEXTS


@functools.lru_cache(maxsize=None)
def _base():
    """Vocabulary and merges of a byte-level BPE of 500 tokens trained with GPT-2's pattern (which keeps digit
    runs together, so multi-digit tokens exist and the digit rules of the other patterns matter)."""
    import json

    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    numbers = [",".join(str(n) for n in range(k, 3000, 7)) for k in range(7)]  # no space: bare digit merges
    tok.train_from_iterator(corpus() + numbers * 3, trainer)
    spec = json.loads(tok.to_str())["model"]
    return spec["vocab"], [tuple(m) for m in spec["merges"]]


@functools.lru_cache(maxsize=None)
def trained(pre: str):
    """A transformers tokenizer of the shared vocabulary with the pre-tokenizer ``pre``."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _base()
    tok = tokenizers.Tokenizer(models.BPE(dict(vocab), list(merges), ignore_merges=pre == "llama-bpe"))
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PATTERNS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def test_digit_rules_are_exercised():
    ids = {pre: trained(pre)("numbers 1234567 and 2026", add_special_tokens=False)["input_ids"]
           for pre in ("gpt-2", "qwen2", "llama-bpe")}
    assert len(set(map(tuple, ids.values()))) == 3  # the three pre-tokenizers disagree on this text


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe"])
def test_vocab_metadata(pre):
    tok = trained(pre)
    meta = vocab_metadata(tok, 512)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == pre
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 512 and tokens[-1] == "[PAD511]"
    for text, i in tok.get_vocab().items():
        assert tokens[i] == text
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert meta["tokenizer.ggml.token_type"][eos] == gguf.TokenType.CONTROL
    assert meta["tokenizer.ggml.eos_token_id"] == eos
    assert meta["tokenizer.ggml.add_bos_token"] is False


def test_unsupported_tokenizers():
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(NotImplementedError, match="byte-level BPE"):
        vocab_metadata(PreTrainedTokenizerFast(tokenizer_object=tok), 16)
    wp = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(NotImplementedError, match="not BPE"):
        vocab_metadata(PreTrainedTokenizerFast(tokenizer_object=wp), 16)
    with pytest.raises(ValueError, match="beyond the model"):
        vocab_metadata(trained("gpt-2"), 128)


@pytest.mark.llama_cpp
@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "bytes"])
def test_llama_cpp_tokenizes_like_transformers(pre, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    if pre == "bytes":  # the demo's tokenizer: one token per byte, no merges, no split pattern
        from jgptq_torch.cli.demo import byte_tokenizer

        tok = byte_tokenizer()
        assert vocab_metadata(tok, 512)["tokenizer.ggml.pre"] == "gpt-2"
    else:
        tok = trained(pre)
    model = build("llama", vocab_size=512)
    path = export_gguf(model, None, tmp_path / "m.gguf", tokenizer=tok, float_type="f32")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            want = tok(text, add_special_tokens=False)["input_ids"]
            got = llm.tokenize(text.encode(), add_bos=False, special=True)
            assert got == want, (pre, text)
            assert llm.detokenize(got, special=True).decode() == text
    finally:
        llm.close()
