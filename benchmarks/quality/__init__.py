"""Pieces of the ``gguf_quality`` benchmark: corpus, byte-level MoE model, llama.cpp side, KL statistics."""
