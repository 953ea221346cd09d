"""Tokenizer metadata for GGUF files: byte-level BPE (GPT-2 style) vocabularies that llama.cpp tokenizes alike.

llama.cpp does not run the tokenizer's own pre-tokenizer: it picks a built-in one by name
(``tokenizer.ggml.pre``). A vocabulary is only written when the tokenizer's pre-tokenizer is exactly one that
llama.cpp implements:

- ``"gpt-2"``: ``ByteLevel(use_regex=True)`` (GPT-2's pattern), or a pattern-less ``ByteLevel`` with no merges
  (every byte its own token, however the text is split);
- ``"qwen2"``: ``Split`` with Qwen2's pattern (digits one by one), then ``ByteLevel(use_regex=False)``;
- ``"llama-bpe"``: ``Split`` with Llama 3's pattern (digits by up to three), then ``ByteLevel(use_regex=False)``;
  its BPE model must set ``ignore_merges`` (llama.cpp forces it for this pre-tokenizer).

Anything else (SentencePiece, WordPiece, byte fallback, other patterns, normalizers other than NFC, added tokens
that are not special) raises NotImplementedError: a vocabulary that tokenizes differently would silently change
every prompt. An NFC normalizer is accepted as llama.cpp's own converter accepts it (llama.cpp does not normalize;
text already in NFC, as most text is, tokenizes alike).
"""

from __future__ import annotations

import json

import gguf

# Pre-tokenizer split patterns as transformers tokenizer.json files spell them -> llama.cpp pre-tokenizer name.
SPLIT_PATTERNS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
}
IGNORE_MERGES = {"llama-bpe"}  # llama.cpp sets ignore_merges for these


def _unsupported(why: str):
    raise NotImplementedError(f"GGUF tokenizer: {why}; only byte-level BPE tokenizers with the GPT-2, Qwen2 or "
                              f"Llama 3 pre-tokenizer are written (pass tokenizer=None for a GGUF fed with token "
                              f"ids)")


def _pre_name(spec: dict) -> str:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        if steps[0].get("add_prefix_space"):
            _unsupported("a ByteLevel pre-tokenizer with add_prefix_space")
        if not steps[0].get("use_regex", True) and (spec.get("model") or {}).get("merges"):
            _unsupported("a ByteLevel pre-tokenizer without a split pattern (and merges that span pieces)")
        return "gpt-2"  # without merges every byte is its own token, whatever the split
    if (len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("add_prefix_space") and not steps[1].get("use_regex", True)):
        split = steps[0]
        pattern = (split.get("pattern") or {}).get("Regex")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            _unsupported("a Split pre-tokenizer that does not isolate its matches")
        if pattern in SPLIT_PATTERNS:
            return SPLIT_PATTERNS[pattern]
        _unsupported(f"the split pattern {pattern!r} is none that llama.cpp implements here")
    _unsupported(f"the pre-tokenizer {pre.get('type')!r} is not byte-level BPE")


def vocab_metadata(tokenizer, vocab_size: int) -> dict:
    """``tokenizer.*`` GGUF metadata of a transformers fast tokenizer (byte-level BPE), for a model of
    ``vocab_size`` embedding rows (ids the tokenizer lacks become unused ``[PAD<id>]`` tokens).

    Raises:
      NotImplementedError: a tokenizer llama.cpp would tokenize differently (see the module docstring).
      ValueError: a tokenizer with more tokens than the model has embeddings.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        _unsupported(f"{type(tokenizer).__name__} is not a fast (tokenizers-backed) tokenizer")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        _unsupported(f"the tokenizer model is {model.get('type')!r}, not BPE")
    if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") \
            or model.get("dropout"):
        _unsupported("BPE with byte fallback, subword prefixes/suffixes or dropout")
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        _unsupported(f"the normalizer {norm.get('type')!r}")
    dec = spec.get("decoder") or {}
    if dec.get("type") != "ByteLevel":
        _unsupported(f"the decoder {dec.get('type')!r} is not ByteLevel")
    pre = _pre_name(spec)
    if bool(model.get("ignore_merges", False)) != (pre in IGNORE_MERGES):
        _unsupported(f"ignore_merges={model.get('ignore_merges', False)} differs from llama.cpp's {pre!r} setting")

    vocab = dict(model["vocab"])
    special = set()
    for added in spec.get("added_tokens") or []:
        if not added.get("special"):
            _unsupported(f"the added token {added['content']!r} is not special")
        vocab[added["content"]] = added["id"]
        special.add(added["id"])
    if max(vocab.values()) >= vocab_size:
        raise ValueError(f"GGUF tokenizer: token id {max(vocab.values())} is beyond the model's {vocab_size} "
                         f"embeddings")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in vocab.items():
        if types[i] != gguf.TokenType.UNUSED:
            raise ValueError(f"GGUF tokenizer: id {i} names two tokens")
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        # GGUF holds no empty arrays and llama.cpp requires the key: one merge of two 2-character pieces, which
        # never forms when nothing else merges (every symbol stays a single character), so nothing changes.
        if any(len(t) != 1 for t, i in vocab.items() if i not in special):
            _unsupported("a BPE vocabulary without merges whose tokens are not single characters")
        piece = 2 * min(t for t, i in vocab.items() if i not in special)
        merges = [f"{piece} {piece}"]

    k = gguf.Keys.Tokenizer
    meta = {k.MODEL: "gpt2", k.PRE: pre, k.LIST: tokens, k.TOKEN_TYPE: [int(t) for t in types], k.MERGES: merges}
    for key, tid in ((k.BOS_ID, tokenizer.bos_token_id), (k.EOS_ID, tokenizer.eos_token_id),
                     (k.UNK_ID, tokenizer.unk_token_id), (k.PAD_ID, tokenizer.pad_token_id)):
        if tid is not None:
            meta[key] = int(tid)
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    meta[k.ADD_BOS] = bool(tokenizer.bos_token_id is not None and len(with_special) > len(plain)
                           and with_special[0] == tokenizer.bos_token_id)
    meta[k.ADD_EOS] = bool(tokenizer.eos_token_id is not None and len(with_special) > len(plain)
                           and with_special[-1] == tokenizer.eos_token_id)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        meta[k.CHAT_TEMPLATE] = template
    return meta
