"""The ``jgptq`` command line: options (:mod:`.main`), ``jgptq quantize`` (:mod:`.command`, with the checks of
:mod:`.command_inputs`), ``jgptq demo`` (:mod:`.demo`) and ``jgptq eval`` (:mod:`.evaluate`, which runs GGUF
files through :mod:`.llama_logits`)."""
