"""A bucket of same-shape matrices quantized under one plan: the one place where weights become codes.

Both fronts call :func:`quantize_bucket`: the torch pipeline once per shape bucket of a decoder layer (every
expert of a shape at once), the JAX-native front once per captured weight. The plan names a method
(:mod:`jgptq.methods`: ``"gptq"``, ``"rtn"`` or a registered plug-in) and the method solves the bucket; what every
method shares is here:

- the token threshold: for a method that needs calibration tokens (GPTQ), a matrix whose statistics saw fewer
  tokens than ``threshold`` (an expert rarely or never routed to) falls back to round-to-nearest (the plain encode
  for GGML formats), reported as ``rtn`` with the reason; so is a matrix the method itself chose not to solve
  (GPTQ's guard on GGML formats, reason ``lower loss: plain ... < gptq ...``);
- GGML formats: the payload bytes are the method's own and the weight returned is exactly their decode;
- the per-matrix figures (loss NaN where the method's solve was not kept) and labels of :class:`Solved`.

A Hessian that no damping makes positive definite falls back to round-to-nearest inside the solver
(``fallback``). The Hessians of a bucket (:func:`bucket_hessians`: shared ones passed once, as (C, C), so their
factorization is shared too) are here for the methods to use; the Hessian-weighted loss
``trace((W - Q) H (W - Q)^T)`` is :func:`jgptq.objective.hessian_loss`.

Example::

    from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
    plan = MatrixPlan("gptq", QuantConfig(bits=4, group_size=128))
    (solved,) = quantize_bucket([Stack("mlp.experts.down_proj", w, h, tokens)], plan)   # w (E, R, C), h (E, C, C)
    solved.weight            # float32 (E, R, C) on the device
    solved.record()          # jgptq.export.QuantizedWeight (E, R, C): codes, scales, zeros, g_idx
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jgptq.objective import hessian_loss  # noqa: F401 - the methods' objective, named here too
from jgptq.config import QuantConfig
from jgptq.parallel import memory
from jgptq.export.records import GGMLWeight, QuantizedWeight


class MatrixPlan(NamedTuple):
    """How one matrix is quantized: ``method`` (a name of :mod:`jgptq.methods`: ``"gptq"``, ``"rtn"``, ...) and
    ``quant`` (its grid, or its GGML format in ``quant.format``); ``routed``: a stack of routed experts, whose
    solve needs the MoE token threshold (:meth:`jgptq.config.MoEConfig.threshold`; other matrices fall back only
    when never reached). Hashable: matrices of one shape and one plan form a bucket."""

    method: str
    quant: QuantConfig
    routed: bool = False

    def threshold(self, expert_threshold: int) -> int:
        """Fewest calibration tokens for a GPTQ solve of this matrix, given the layer's ``expert_threshold``."""
        return expert_threshold if self.routed else 1

    @property
    def format(self) -> str:
        """``"int"`` (integer grids) or the GGML format name."""
        return self.quant.format


class Stack(NamedTuple):
    """``n`` same-shape matrices that enter a bucket together (a linear module: n = 1; fused experts: n = E).

    Attributes:
      name: what they are, for messages (e.g. ``model.layers.3.mlp.experts.down_proj``).
      weight: float (n, R, C) in nn.Linear orientation (out, in), any float dtype.
      hessian: float32 (C, C) shared by the n matrices, (n, C, C), or None (never calibrated).
      tokens: n token counts behind the Hessians.
      hessian_key: equal keys within a bucket name the same Hessian (its factorization is then shared).
      importance: float32 (n, C) per-column importance for GGML encoders, or None.
      statistics: the finalized results of other statistics a method declares (:mod:`jgptq.statistics`), by
        name, each (C, C) shared like the Hessian (same ``hessian_key``) or (n, C, C); a name missing or None:
        never collected for these matrices (e.g. ``"error_cross"`` where the run's inputs are the float model's).
      input_scale: float32 (C,) the matrices' inputs were divided by (a pre-scaling method's, its columns folded
        into ``weight`` already), or None: the solve uses ``diag(s)^-1 H diag(s)^-1``
        (:func:`jgptq.methods.awq.scaled_hessian`), the Hessian of the scaled inputs.
    """

    name: str
    weight: jax.Array
    hessian: Optional[jax.Array]
    tokens: Sequence[int]
    hessian_key: str = ""
    importance: Optional[object] = None
    statistics: Optional[dict] = None
    input_scale: Optional[object] = None


def _inputs_scaled(stack: Stack) -> Stack:
    """``stack`` with its Hessian that of the inputs divided by ``input_scale`` (none left to apply)."""
    if stack.input_scale is None:
        return stack
    from jgptq.methods.awq import scaled_hessian

    h = None if stack.hessian is None else scaled_hessian(stack.hessian, stack.input_scale)
    return stack._replace(hessian=h, input_scale=None)


_FIGURES = ("loss", "damp_used", "damp_stage", "fallback", "dead_columns")
_ARRAYS = ("codes", "scales", "zeros", "g_idx", "perm", "payload")


@dataclasses.dataclass
class Solved:
    """What :func:`quantize_bucket` made of one :class:`Stack` (leading axis n everywhere).

    Attributes:
      weight: float32 jax (n, R, C), the dequantized weights (the decode of ``payload`` for GGML formats).
      plan: the :class:`MatrixPlan`.
      method, reason: per matrix, the method's name, or ``"rtn"`` and why for a fallback (reason empty when
        not a fallback).
      loss, damp_used, damp_stage, fallback, dead_columns: numpy (n,) figures (loss NaN where not solved by GPTQ;
        see :class:`jgptq.gptq.GPTQResult`).
      codes, scales, zeros, g_idx, perm: integer-grid arrays on the device (None for GGML formats);
      payload: GGML blocks uint8 (n, R, C // block, type_size) on the device (None for integer grids).
    """

    weight: Optional[jax.Array]
    plan: MatrixPlan
    method: tuple
    reason: tuple
    loss: np.ndarray
    damp_used: np.ndarray
    damp_stage: np.ndarray
    fallback: np.ndarray
    dead_columns: np.ndarray
    codes: Optional[object] = None
    scales: Optional[object] = None
    zeros: Optional[object] = None
    g_idx: Optional[object] = None
    perm: Optional[object] = None
    payload: Optional[object] = None

    def host(self, to_host=np.asarray) -> "Solved":
        """This result with its arrays in host memory (numpy, by ``to_host``) and without the dequantized weight."""
        arrays = {k: None if getattr(self, k) is None else to_host(getattr(self, k)) for k in _ARRAYS}
        return dataclasses.replace(self, weight=None, **arrays)

    def record(self, index=None, rows=None, *, transposed: bool = False):
        """The checkpoint record of the stack, of one matrix (``index``) or of some of its rows.

        Args:
          index: None (the whole stack, n leading), or the matrix to take.
          rows: a numpy index (slice or integer array) of output rows, or None for all.
          transposed: the checkpoint stores the tensor as (..., in, out).
        Returns:
          A :class:`jgptq.export.QuantizedWeight` (integer grids) or :class:`jgptq.export.GGMLWeight`; its
          method is the matrix's, or ``"mixed"`` for a stack holding both.
        """
        method = self.method[0] if len(set(self.method)) == 1 else "mixed"
        if self.plan.quant.is_ggml:
            whole = GGMLWeight(np.asarray(self.payload), self.plan.format, method=method, transposed=transposed)
        else:
            q = self.plan.quant
            whole = QuantizedWeight(*(np.asarray(a) for a in (self.codes, self.scales, self.zeros, self.g_idx)),
                                    bits=q.bits, group_size=q.group_size, sym=q.sym, act_order=q.act_order,
                                    scale_dtype=q.scale_dtype, method=method, transposed=transposed)
        if index is None and rows is None:
            return whole
        return whole.take(index, rows, method=None if index is None else self.method[index])

    @classmethod
    def concat(cls, parts: Sequence[Solved]) -> Solved:
        """One result of a stack solved in parts of consecutive matrices (in order, one plan): arrays and figures
        joined on the leading axis, in host memory (numpy), without the dequantized weight."""
        parts = [p.host() for p in parts]
        arrays = {k: None if getattr(parts[0], k) is None else np.concatenate([getattr(p, k) for p in parts])
                  for k in _ARRAYS + _FIGURES}
        return dataclasses.replace(parts[0], method=sum((p.method for p in parts), ()),
                                   reason=sum((p.reason for p in parts), ()), **arrays)

    def figures(self) -> dict:
        """Plain-Python per-matrix figures (lists of n): method, reason and the solver's figures."""
        out = {k: np.asarray(getattr(self, k)).tolist() for k in _FIGURES}
        return {"method": list(self.method), "reason": list(self.reason), **out}


_decoders: dict = {}
_decoders_lock = threading.Lock()


def compiled_decode(format_name: str, shape: tuple, device):
    """The compiled decode of GGML ``format_name`` for a uint8 payload of ``shape`` (..., bytes) placed on
    ``device``, compiled once per process (the program of :func:`jgptq.ggml.decode`, so the same bytes). Kept here
    rather than in JAX's call cache, so that a program compiled ahead on another thread
    (:func:`jgptq_torch.pipeline.solve.warm_solves`) is found whatever JAX keys its calls on."""
    from jgptq.ggml import get_format

    key = (format_name, tuple(shape), device)
    with _decoders_lock:
        hit = _decoders.get(key)
    if hit is None:
        struct = jax.ShapeDtypeStruct(tuple(shape), jnp.uint8, sharding=jax.sharding.SingleDeviceSharding(device))
        hit = get_format(format_name).decode.lower(struct).compile()
        with _decoders_lock:
            hit = _decoders.setdefault(key, hit)
    return hit


def decode_payload(payload, format_name: str) -> jax.Array:
    """float32 (..., C): the decode of uint8 ``payload`` (..., bytes) of ``format_name``, through
    :func:`compiled_decode` when it is a jax array on one device, else :func:`jgptq.ggml.decode`."""
    from jgptq.ggml import decode, get_format

    devices = payload.devices() if isinstance(payload, jax.Array) else ()
    if len(devices) != 1 or payload.dtype != jnp.uint8 or not hasattr(get_format(format_name).decode, "lower"):
        return decode(payload, format_name)
    return compiled_decode(format_name, payload.shape, next(iter(devices)))(payload)


@functools.lru_cache(maxsize=None)
def plain_encoder(format_name: str):
    """``fn(weight (R, C), importance (C,) or None) -> (payload uint8 (R, C // block, type_size), decoded
    float32 (R, C))``: the plain encode of a GGML format (one function object per format, so compiles are
    cached)."""
    from jgptq.ggml import get_format

    fmt = get_format(format_name)

    def encode(weight, importance):
        w = weight.astype(jnp.float32)
        payload = fmt.encode(w) if importance is None else fmt.encode(w, importance.astype(jnp.float32))
        return payload.reshape(w.shape[0], -1, fmt.type_size), fmt.decode(payload)

    return encode


def quantize_bucket(stacks: Sequence[Stack], plan: MatrixPlan, *, threshold: int = 1, devices=None,
                    memory_limit=None) -> list:
    """Quantizes every matrix of same-shape ``stacks`` under one ``plan`` in one batched call of the plan's method
    (:func:`jgptq.methods.get`).

    Args:
      stacks: :class:`Stack` s of one (R, C) shape; N matrices in all.
      plan: the :class:`MatrixPlan` of every matrix of the bucket.
      threshold: fewest calibration tokens for a method that needs them (``token_threshold``, e.g. GPTQ); below
        it, the fallback above.
      devices: JAX devices for the solve (default: every local device).
      memory_limit: the bytes the solve may hold on each device (an int, or a mapping device -> bytes; None: what
        the devices have free), e.g. what a framework sharing the device leaves to it
        (:func:`jgptq.parallel.memory.granted`: the method's room checks plan within it).
    Returns:
      One :class:`Solved` per stack, in order; the bytes are the same whatever the devices.
    Raises:
      ValueError: shapes that disagree, an unknown method, NaN/Inf in a weight, a Hessian or an importance vector
        (the solver's checks; a NaN/Inf Hessian means NaN/Inf calibration activations), a width the grid or format
        does not divide.
    """
    from jgptq import methods

    stacks = [_inputs_scaled(s) for s in stacks]
    shapes = {tuple(s.weight.shape[1:]) for s in stacks}
    if len(shapes) != 1:
        raise ValueError(f"quantize_bucket: stacks of different shapes {sorted(shapes)} "
                         f"({', '.join(s.name for s in stacks)})")
    rows, cols = shapes.pop()
    method = methods.get(plan.method)
    tokens = [int(t) for s in stacks for t in s.tokens]
    low = tuple(method.token_threshold and t < threshold for t in tokens)
    reasons = [f"{t} tokens < {threshold}" if is_low else "" for t, is_low in zip(tokens, low)]
    weights = stacks[0].weight if len(stacks) == 1 else jnp.concatenate([s.weight for s in stacks])
    quant, ggml = plan.quant, plan.quant.is_ggml
    importance = None
    if ggml and stacks[0].importance is not None:
        importance = jnp.concatenate([jnp.asarray(s.importance, jnp.float32) for s in stacks])
    names = ", ".join(s.name for s in stacks)
    with contextlib.nullcontext() if memory_limit is None else memory.granted(memory_limit):
        out = method.solve(methods.BucketInputs(stacks, weights, importance, plan, low, f"{names} ({rows}x{cols})",
                                                devices))
    fields = {k: out.fields.get(k) for k in ("weight",) + _FIGURES + _ARRAYS}
    for i, why in out.fell_back.items():
        reasons[i] = why
    n = len(tokens)
    if ggml:  # the weight is the decode of the kept bytes, exactly as GGMLWeight.dequantize
        fields["weight"] = decode_payload(fields["payload"].reshape(n, rows, -1), quant.format)
        for k in ("codes", "scales", "zeros", "g_idx", "perm"):
            fields[k] = None
    for k, empty in (("loss", np.nan), ("damp_used", np.nan), ("damp_stage", -1), ("fallback", False),
                     ("dead_columns", 0)):
        fields[k] = np.full(n, empty) if fields.get(k) is None else np.asarray(fields[k])
    not_solved = [is_low or i in out.fell_back for i, is_low in enumerate(low)]
    fields["loss"] = np.where(np.asarray(not_solved), np.nan, fields["loss"])  # no loss where it was not kept
    labels = ["rtn" if skip else method.name for skip in not_solved]
    solved, start = [], 0
    for s in stacks:
        sl = slice(start, start + s.weight.shape[0])
        whole = len(stacks) == 1
        part = {k: None if v is None else v if whole else v[sl] for k, v in fields.items()}
        solved.append(Solved(plan=plan, method=tuple(labels[sl]), reason=tuple(reasons[sl]), **part))
        start = sl.stop
    return solved


PLAIN_KEPT = "lower loss"   # the reason of a matrix whose plain encode scored below its GPTQ solve




@jax.jit
def _identity_where(hessians, mask):
    eye = jnp.eye(hessians.shape[-1], dtype=jnp.float32)
    return jnp.where(mask[:, None, None], eye, hessians.astype(jnp.float32))


def bucket_hessians(stacks, low, cols) -> jax.Array:
    """(C, C) when every matrix shares one Hessian and none falls back, else (N, C, C) with identities."""
    keys = {s.hessian_key for s in stacks}
    shared = len(keys) == 1 and all(s.hessian is None or s.hessian.ndim == 2 for s in stacks)
    if shared and not any(low):
        return next(s.hessian for s in stacks)
    if shared and all(low):
        return jnp.eye(cols, dtype=jnp.float32)
    pieces = []
    for s in stacks:
        n = s.weight.shape[0]
        h = s.hessian if s.hessian is not None else jnp.zeros((cols, cols), jnp.float32)
        pieces.append(jnp.broadcast_to(h, (n, cols, cols)) if h.ndim == 2 else h)
    if len(pieces) == 1 and pieces[0].ndim == 3 and not any(low) and pieces[0].dtype == jnp.float32:
        return pieces[0]
    stacked = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    return _identity_where(stacked, jnp.asarray(low))
