"""Runs llama.cpp's ``convert_hf_to_gguf.py`` (argv[1]: the llama.cpp source folder; the rest: the converter's
arguments) with that folder's ``gguf-py``, naming the pre-tokenizer ``gpt-2``.

The converter recognises a pre-tokenizer by the hash of a reference text's tokens; the tests' tiny byte-level
vocabulary (GPT-2's split pattern) has no entry in its table, so the name it would look up is given here. With
``JGPTQ_CONVERTER_BPE_VOCAB=1`` the model's class reads that vocabulary as GPT-2's too, for families whose
converter reads only a SentencePiece one (the tests compare the architecture, not that reader).
"""

import os
import runpy
import sys

source = sys.argv[1]
sys.path[:0] = [source, source + "/gguf-py"]

from conversion import base  # noqa: E402  (the converter's own package, found through the path above)

import conversion  # noqa: E402

base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
if os.environ.get("JGPTQ_CONVERTER_BPE_VOCAB") == "1":
    found = conversion.get_model_class

    def model_class(name, mmproj=False):
        cls = found(name, mmproj=mmproj)
        if not mmproj:
            cls.set_vocab = base.TextModel._set_vocab_gpt2
        return cls

    conversion.get_model_class = model_class
sys.argv = [source + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
