"""Quantization methods as plug-ins (see :mod:`jgptq.methods.registry` for what a method is and how to add one).

Built in: ``"gptq"`` (:mod:`jgptq.methods.gptq`) and ``"rtn"`` (:mod:`jgptq.methods.rtn`)."""

from jgptq.methods.registry import BucketInputs, BucketOutput, Method, get, names, register, unregister

__all__ = ["BucketInputs", "BucketOutput", "Method", "get", "names", "register", "unregister"]
