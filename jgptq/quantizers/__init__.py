"""What a group of weights becomes: uniform integer grids (GGML block codecs live in :mod:`jgptq.ggml`)."""

from jgptq.quantizers.uniform import Grid, dequantize, fake_quantize, fit, fit_groups, quantize, round_to_nearest

__all__ = ["Grid", "dequantize", "fake_quantize", "fit", "fit_groups", "quantize", "round_to_nearest"]
