"""Quantization methods as plug-ins (see :mod:`jgptq.methods.registry` for what a method is and how to add one).

Built in: ``"gptq"`` (:mod:`jgptq.methods.gptq`), ``"rtn"`` (:mod:`jgptq.methods.rtn`) and ``"gptq_search"`` /
``"gptq_search_diag"`` (GPTQ with grids searched on the Hessian-weighted error, :mod:`jgptq.methods.gptq_search`),
``"gptq_ef"`` / ``"gptq_ef_half"`` (GPTQ of a weight corrected toward the float model's output, error feedback:
:mod:`jgptq.methods.error_feedback`), ``"awq"`` / ``"awq_rtn"`` (activation-aware pre-scaling folded into the
input's producer, then GPTQ or round-to-nearest: :mod:`jgptq.methods.awq`)."""

from jgptq.methods.registry import BucketInputs, BucketOutput, Method, get, names, register, unregister

__all__ = ["BucketInputs", "BucketOutput", "Method", "get", "names", "register", "unregister"]
