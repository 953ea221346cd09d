"""Reading a checkpoint as plain float weights: the source formats a release may ship in (FP8 with 128x128 block
scales, MXFP4 experts, compressed-tensors ``pack-quantized`` integers) recognised from ``config.json``
(:mod:`.formats`) and dequantized on read, one subset of tensors at a time (:mod:`.dequant`, with one file per
format: :mod:`.fp8`, :mod:`.mxfp4`, :mod:`.packed`)."""

from .dequant import companions, dequantize_tensors
from .formats import PackScheme, SourceFormat, source_format

__all__ = ["PackScheme", "SourceFormat", "companions", "dequantize_tensors", "source_format"]
