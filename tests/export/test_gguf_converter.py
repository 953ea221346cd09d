"""The float32 GGUF export against llama.cpp's own converter (``convert_hf_to_gguf.py``) on the same saved model:
the same tensors (names, shapes, types, bytes) and the same metadata, but for the differences listed here.

Differences every family has (the converter's or jgptq's choices that llama.cpp's graph does not read):
- ``general.*`` but ``general.architecture``, ``general.file_type`` and ``general.quantization_version``:
  provenance (name, size label, type); jgptq writes the folder name, the converter a title-cased one.
- ``tokenizer.ggml.add_bos_token``/``add_eos_token``: jgptq writes the tokenizer's own flags (False), the
  converter writes them only when tokenizer_config.json sets them.
- ``tokenizer.ggml.bos_token_id``/``padding_token_id``: the converter also takes special token ids from the
  model's config.json (the tiny configs name ids the tokenizer does not declare); jgptq writes the tokenizer's.
- Hyperparameters one side writes where the other leaves llama.cpp's default (:data:`DEFAULTS`): accepted only
  when the written value is that default.
Each family lists its own exceptions in :data:`EXCEPTIONS` (metadata keys) and :data:`TENSOR_EXCEPTIONS`.
"""

import functools

import gguf
import numpy as np
import pytest

from jgptq_torch.export.gguf.export import export_gguf
from tests.export import converter
from tests.export.family_models import BPE_VOCAB, CONVERTER_ARGS, MODELS, REFUSED, build

pytestmark = pytest.mark.llama_cpp

SHARED = {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.bos_token_id",
          "tokenizer.ggml.padding_token_id"}


def _head(meta, arch):
    return meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"]


# key without the architecture prefix -> llama.cpp's value when the key is absent (from the loader, src/llama-model.cpp)
DEFAULTS = {
    "vocab_size": lambda meta, arch: len(meta["tokenizer.ggml.tokens"]),
    "attention.key_length": _head,
    "attention.value_length": _head,
    "rope.dimension_count": lambda meta, arch: meta.get(f"{arch}.attention.key_length", _head(meta, arch)),
    "nextn_predict_layers": lambda meta, arch: 0,
}
# family -> {metadata key (without the architecture prefix, but for tokenizer.*): why it may differ}
EXCEPTIONS = {
    "llama": {},
    "mixtral": {},
    "qwen3_moe": {},
    "olmoe": {},
    "qwen2_moe": {},
    "deepseek_v3": {},
    "dots1": {},
    "ernie4_5_moe": {},
    "granitemoe": {},
    "granitemoeshared": {},
    "minimax_m2": {},
    "gpt_oss": {},
    "llama4_text": {},
    "lfm2_moe": {},
    "afmoe": {},
    "qwen3_next": {"attention.recurrent_layers": "the converter lists each layer's kind; jgptq writes "
                   "full_attention_interval, from which llama.cpp derives the same kinds (the gguf package has no key "
                   "for the list; test_qwen3_next_layer_kinds)"},
    "qwen3_5_moe_text": {"attention.recurrent_layers": "as qwen3_next's"},
    "hunyuan_v1_moe": {
        "context_length": "HunYuan's converter pins 256k tokens for alpha-scaled rotary bases (llama.cpp reads it as "
                          "the default context size, not in the graph); jgptq writes max_position_embeddings",
        "rope.scaling.original_context_length": "the same 256k (read only by YaRN scaling)",
        "tokenizer.ggml.seperator_token_id": "the converter also takes config.json's sep_token_id; jgptq writes "
                                             "the tokenizer's special tokens"},
    "glm4_moe": {k: "GLM's converter pins chat tokens ([gMASK] as bos, <|user|> as eot, <|endoftext|> as unk, "
                    "<|observation|> as eom) by name; jgptq writes the tokenizer's own special tokens"
                 for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.unknown_token_id",
                           "tokenizer.ggml.eom_token_id")},
}
# family -> {tensor name without "blk.N.": (the difference, why llama.cpp loads both alike)}
TENSOR_EXCEPTIONS = {
    "ernie4_5_moe": {"exp_probs_b.bias": "written as {n_expert}, the converter's as {n_expert, 1} (transformers "
                                         "keeps it (1, E)): the same extent and bytes, loaded as {n_expert}"},
    "qwen2_moe": {"ffn_gate_inp_shexp.weight": "written as {n_embd}, the converter's as {n_embd, 1}: the same "
                                              "ggml extent and bytes, and llama.cpp loads it as {n_embd}"},
    "qwen3_next": {"ffn_gate_inp_shexp.weight": "as qwen2_moe's"},
    "qwen3_5_moe_text": {"ffn_gate_inp_shexp.weight": "as qwen2_moe's"},
}
ALWAYS = {"general.architecture", "general.file_type", "general.quantization_version"}


@functools.lru_cache(maxsize=None)
def _source():
    return converter.source()


@functools.lru_cache(maxsize=None)
def converted(family: str, folder):
    """(model, jgptq's F32 GGUF, the converter's F32 GGUF) of the tiny model of ``family``."""
    src = _source()
    if src is None:
        pytest.skip("llama.cpp's converter not found (set JGPTQ_LLAMA_CPP_SRC to the vendored llama.cpp folder)")
    model = build(family)
    folder = folder / family
    tok = converter.save(model, folder)
    theirs = converter.convert(folder, folder / "theirs.gguf", src, bpe_vocab=family in BPE_VOCAB,
                               args=CONVERTER_ARGS.get(family, ()))
    ours = export_gguf(model, None, folder / "ours.gguf", float_type="f32", tokenizer=tok, name=family)
    return model, ours, theirs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("converter")


def _allowed_tensor(family, name, why, ours, theirs):
    short = name.split(".", 2)[2] if name.startswith("blk.") else name
    if short not in TENSOR_EXCEPTIONS.get(family, {}) or not why.startswith("shape"):
        return False
    a, b = ours[name], theirs[name]  # a shape that differs by trailing ones only, and the same bytes
    ext = lambda t: [int(n) for n in t.shape] + [1] * (4 - len(t.shape))  # noqa: E731
    return ext(a) == ext(b) and np.array_equal(np.asarray(a.data).reshape(-1), np.asarray(b.data).reshape(-1))


@pytest.mark.parametrize("family", sorted(set(MODELS) - REFUSED))
def test_float_export_matches_llama_cpp_converter(family, folder):
    model, ours, theirs = converted(family, folder)
    diff = converter.compare(ours, theirs)
    ra, rb = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    tensors = {n: why for n, why in diff["tensors"].items() if not _allowed_tensor(family, n, why, ta, tb)}
    assert tensors == {}, f"{family}: tensors differ from llama.cpp's converter: {tensors}"
    meta = {k: f.contents() for k, f in ra.fields.items()}
    arch = meta["general.architecture"]
    allowed = SHARED | {k if k.startswith("tokenizer.") else f"{arch}.{k}" for k in EXCEPTIONS[family]}
    unexplained = {}
    for key, (mine, theirs_value) in diff["meta"].items():
        short = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if key in allowed or (key.startswith("general.") and key not in ALWAYS):
            continue
        present = theirs_value if mine is None else mine
        if None in (mine, theirs_value) and short in DEFAULTS and present == DEFAULTS[short](meta, arch):
            continue
        unexplained[key] = (mine, theirs_value)
    assert unexplained == {}, f"{family}: metadata differs from llama.cpp's converter: {unexplained}"
    stale = {k for k in allowed if k not in diff["meta"]} - SHARED
    assert not stale, f"{family}: listed exceptions that no longer differ: {stale}"


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_qwen3_next_layer_kinds(family, folder):
    """The converter's per-layer kinds are those llama.cpp derives from jgptq's full_attention_interval (a layer is
    linear attention unless (i + 1) % interval == 0)."""
    _, ours, theirs = converted(family, folder)
    arch = gguf.GGUFReader(str(ours)).fields["general.architecture"].contents()
    interval = gguf.GGUFReader(str(ours)).fields[f"{arch}.full_attention_interval"].contents()
    kinds = gguf.GGUFReader(str(theirs)).fields[f"{arch}.attention.recurrent_layers"].contents()
    assert interval == 4 and kinds == [(i + 1) % interval != 0 for i in range(len(kinds))] == [True] * 3 + [False]
