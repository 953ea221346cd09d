"""Files of a quantized transformers model: compressed-tensors and GPTQ v1 folders (:mod:`.checkpoint`, read back
by :mod:`.read_back`) and GGUF files for llama.cpp (:mod:`jgptq_torch.export.gguf`). The bytes of every format
come from :mod:`jgptq.export`; this floor maps a transformers model's names and layouts onto them."""
