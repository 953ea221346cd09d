"""The methods a matrix can be quantized with, by name: what each needs and how it solves a bucket.

A method is an object with

- ``name``: what plans, configs, records and reports call it;
- ``statistics``: the names of the calibration statistics its solve reads (see :mod:`jgptq.statistics`, e.g.
  ``("hessian",)``); an empty tuple for a method that needs no calibration. The torch pipeline collects the
  Hessian and the importance statistic for every run (:func:`jgptq.statistics.of_config`), the error-feedback
  cross statistic (``"error_cross"``) for a method that declares it, and refuses a method that declares one it
  does not collect; statistics other than the Hessian and the importance reach the solve in each stack's
  ``statistics`` (:class:`jgptq.bucket.Stack`);
- ``token_threshold``: True when a matrix whose statistics saw fewer tokens than the run's threshold (an expert
  rarely or never routed to) is not solved by the method but falls back to round-to-nearest (reported as ``rtn``
  with the reason);
- ``solve(bucket: BucketInputs) -> BucketOutput``: every matrix of a bucket at once (pure JAX, spread over the
  devices by :mod:`jgptq.parallel`).

:func:`jgptq.bucket.quantize_bucket` looks the plan's method up here and does what every method shares: the
checks, the token threshold, the decode of GGML payloads, the per-matrix figures and labels. The built-in methods
are imported on first use (this module imports no JAX, so configurations can check names cheaply).

Adding a method is one module in ``jgptq`` plus its tests::

    from jgptq.methods import BucketOutput, register

    class Halfway:
        name, statistics, token_threshold = "halfway", ("hessian",), True
        def solve(self, bucket):
            ...   # bucket.weights (N, R, C), bucket.hessians(), bucket.importance, bucket.plan.quant
            return BucketOutput(fields={"weight": ..., "codes": ..., ...})

    register(Halfway())
    jgptq.quantize_moe(model, calib, method="halfway")
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Optional, Protocol, Sequence

# built-in method name -> the module that registers it on import
_BUILTIN = {"gptq": "jgptq.methods.gptq", "rtn": "jgptq.methods.rtn", "gptq_search": "jgptq.methods.gptq_search",
            "gptq_search_diag": "jgptq.methods.gptq_search", "gptq_ef": "jgptq.methods.error_feedback",
            "gptq_ef_half": "jgptq.methods.error_feedback", "awq": "jgptq.methods.awq", "awq_rtn": "jgptq.methods.awq"}
_REGISTERED: dict = {}


class BucketInputs(NamedTuple):
    """What a method's ``solve`` gets: the N same-shape matrices of one bucket under one plan.

    Attributes:
      stacks: the :class:`jgptq.bucket.Stack` s, in order (their weights concatenated are ``weights``).
      weights: float (N, R, C), nn.Linear orientation (out, in).
      importance: float32 (N, C) per-column importance for GGML encoders, or None.
      plan: the :class:`jgptq.bucket.MatrixPlan` (``plan.quant``: the grid or GGML format).
      low: N bools: the matrix saw fewer tokens than the threshold (always False for a method without
        ``token_threshold``); the method must give those the fallback (round-to-nearest, the plain GGML encode).
      name: the bucket's name for messages and compiled-program names.
      devices: JAX devices for the solve (None: every local device).
    """

    stacks: Sequence[Any]
    weights: Any
    importance: Optional[Any]
    plan: Any
    low: tuple
    name: str
    devices: Optional[Any] = None

    def hessians(self):
        """float32 (C, C) when every matrix shares one Hessian and none is ``low``, else (N, C, C), with the
        identity for ``low`` matrices (GPTQ under the identity is exactly round-to-nearest)."""
        from jgptq.bucket import bucket_hessians

        return bucket_hessians(self.stacks, self.low, self.weights.shape[-1])


class BucketOutput(NamedTuple):
    """What a method's ``solve`` returns.

    Attributes:
      fields: arrays with leading axis N: ``weight`` float32 (N, R, C) (ignored for GGML formats, whose weight is
        the decode of ``payload``); integer grids: ``codes``, ``scales``, ``zeros``, ``g_idx``, ``perm``; GGML:
        ``payload`` uint8 (N, R, C // block, type_size); optional figures ``loss``, ``damp_used``,
        ``damp_stage``, ``fallback``, ``dead_columns`` (see :class:`jgptq.gptq.GPTQResult`).
      fell_back: per matrix (index -> reason) that the method chose not to solve but to round to nearest (e.g.
        GPTQ's guard kept the plain GGML encode): reported as ``rtn`` with the reason, its loss NaN.
    """

    fields: dict
    fell_back: dict = {}


class Method(Protocol):
    name: str
    statistics: tuple
    token_threshold: bool

    def solve(self, bucket: BucketInputs) -> BucketOutput: ...


def register(method, *, replace: bool = False):
    """Makes ``method`` known under ``method.name``; returns it (usable as a class decorator's last step).

    Raises:
      ValueError: a name already registered (pass ``replace=True`` to replace it), or a method without
        ``name``, ``statistics``, ``token_threshold`` or a callable ``solve``.
    """
    missing = [a for a in ("name", "statistics", "token_threshold") if not hasattr(method, a)]
    if missing or not callable(getattr(method, "solve", None)):
        raise ValueError(f"a method needs name, statistics, token_threshold and solve(bucket); "
                         f"{method!r} lacks {missing or ['solve']}")
    name = method.name
    if not isinstance(name, str) or not name or name == "mixed":
        raise ValueError(f"a method's name must be a non-empty string other than 'mixed', got {name!r}")
    if not replace and name in _REGISTERED:
        raise ValueError(f"a method named {name!r} is already registered (register(..., replace=True) replaces it)")
    _REGISTERED[name] = method
    return method


def names() -> tuple:
    """Every method's name: the built-in ones first, then the registered ones in order."""
    return tuple(_BUILTIN) + tuple(n for n in _REGISTERED if n not in _BUILTIN)


def get(name: str) -> Method:
    """The method registered as ``name`` (a built-in one is imported on first use).

    Raises:
      ValueError: no method of that name (the message lists the known ones).
    """
    if name not in _REGISTERED and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    try:
        return _REGISTERED[name]
    except KeyError:
        raise ValueError(f"unknown quantization method {name!r}; known methods: {list(names())}") from None


def unregister(name: str) -> None:
    """Forgets a registered method (a built-in one comes back on the next :func:`get`)."""
    _REGISTERED.pop(name, None)

