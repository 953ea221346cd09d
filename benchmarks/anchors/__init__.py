"""Anchors: the reference implementations jgptq is measured against (torch GPTQ loop, llama.cpp's C codecs)."""
