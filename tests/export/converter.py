"""llama.cpp's own converter (``convert_hf_to_gguf.py``) as the oracle of the GGUF exporter.

:func:`source` finds the converter: ``$JGPTQ_LLAMA_CPP_SRC`` (the llama.cpp folder of the llama-cpp-python
sdist, ``vendor/llama.cpp``), else the path ``.ci/llama_cpp`` wrote into its cache. :func:`save` writes a tiny
model with a byte-level BPE tokenizer; :func:`convert` runs the converter on it (F32, in a subprocess);
:func:`compare` lists every difference between two GGUF files.
"""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).parent
CACHE_FILE = "llama-cpp-src.path"
VOCAB = 272  # the tokenizer's 261 tokens and a few unused ids


def source() -> Path | None:
    """The llama.cpp source folder holding ``convert_hf_to_gguf.py``, or None."""
    given = os.environ.get("JGPTQ_LLAMA_CPP_SRC")
    if not given:
        cache = Path(os.environ.get("JGPTQ_CI_CACHE") or Path(os.environ.get("XDG_CACHE_HOME")
                                                              or Path.home() / ".cache") / "jgptq-ci")
        if (cache / CACHE_FILE).is_file():
            given = (cache / CACHE_FILE).read_text().strip()
    if given and (Path(given) / "convert_hf_to_gguf.py").is_file():
        return Path(given)
    return None


def tokenizer():
    """A transformers fast tokenizer: the 256 byte symbols of byte-level BPE, four merges, GPT-2's split pattern,
    ``<|endoftext|>`` (id 260) as its end-of-sequence token and the special tokens GLM's converter looks up
    (ids 261-263)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "[gMASK]", "<|user|>", "<|observation|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def save(model, folder: Path):
    """Writes ``model`` (safetensors) and :func:`tokenizer` into ``folder``; returns the tokenizer."""
    tok = tokenizer()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return tok


def convert(folder: Path, out: Path, src: Path, bpe_vocab: bool = False, args: tuple = ()) -> Path:
    """Runs llama.cpp's converter on the saved model ``folder`` (``--outtype f32``, then ``args``) and returns
    ``out``; ``bpe_vocab``: the family's converter reads the byte-level BPE vocabulary as GPT-2's (see
    run_converter)."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["JGPTQ_CONVERTER_BPE_VOCAB"] = "1" if bpe_vocab else "0"
    done = subprocess.run([sys.executable, str(HERE / "run_converter.py"), str(src), str(folder), "--outtype", "f32",
                           "--outfile", str(out), *args], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{done.stderr[-4000:]}")
    return out


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def compare(ours: Path, theirs: Path) -> dict:
    """Every difference between two GGUF files: ``{"meta": {key: (ours, theirs)}, "tensors": {name: why}}``
    (a value missing from one file is None; a tensor differs by presence, type, shape or bytes)."""
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ma, mb = _fields(a), _fields(b)
    meta = {k: (ma.get(k), mb.get(k)) for k in set(ma) | set(mb) if ma.get(k) != mb.get(k)}
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    tensors = {}
    for name in set(ta) | set(tb):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            tensors[name] = "only in " + ("theirs" if x is None else "ours")
        elif x.tensor_type != y.tensor_type:
            tensors[name] = f"type {x.tensor_type.name} vs {y.tensor_type.name}"
        elif list(x.shape) != list(y.shape):
            tensors[name] = f"shape {list(x.shape)} vs {list(y.shape)}"
        elif not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            tensors[name] = "bytes"
    return {"meta": meta, "tensors": tensors}
