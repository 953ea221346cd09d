"""A bucket of same-shape matrices quantized under one plan: the one place where weights become codes.

Both fronts call :func:`quantize_bucket`: the torch pipeline once per shape bucket of a decoder layer (every
expert of a shape at once), the JAX-native front once per captured weight. It owns every decision that follows
from the plan and the calibration, and every fallback:

- ``method="gptq"``: one batched solve (:func:`jgptq.parallel.solve_experts`, spread over the devices); Hessians
  shared by every matrix of the bucket (a tie: q/k/v, or gate/up of a dense MLP) are passed once, as (C, C), so
  the factorization is shared too; a matrix whose Hessian saw fewer tokens than ``threshold`` (an expert rarely
  or never routed to) gets the identity as its Hessian, for which GPTQ is exactly round-to-nearest, and with a
  GGML format exactly the plain encode (an identity Hessian is not quite that for formats whose importance
  weighting looks at the whole row); such matrices are reported as ``rtn`` with the reason; a Hessian that no
  damping makes positive definite falls back to round-to-nearest inside the solver (``fallback``);
- ``method="rtn"``: round-to-nearest on the same grids, or with a GGML format the plain encode with importance
  (llama.cpp's imatrix-only quantization);
- GGML formats with ``method="gptq"``: each matrix is also given the plain encode (with the same importance) in
  the same program, both results are scored by the Hessian-weighted loss ``trace((W - Q) H (W - Q)^T)`` on the
  matrix's own calibration Hessian (float32, fixed summation order), and the lower is kept; a matrix whose plain
  encode wins is reported as ``rtn`` with the reason ``lower loss: plain ... < gptq ...``. The guard costs one plain
  encode and two (R, C) x (C, C) products per matrix;
- GGML formats: the payload bytes are the solver's own (or the plain encode's, above) and the weight returned is
  exactly their decode.

Example::

    from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
    plan = MatrixPlan("gptq", QuantConfig(bits=4, group_size=128))
    (solved,) = quantize_bucket([Stack("mlp.experts.down_proj", w, h, tokens)], plan)   # w (E, R, C), h (E, C, C)
    solved.weight            # float32 (E, R, C) on the device
    solved.record()          # jgptq.export.QuantizedWeight (E, R, C): codes, scales, zeros, g_idx
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import gptq, parallel
from jgptq.objective import hessian_loss
from jgptq.config import QuantConfig
from jgptq.export.records import GGMLWeight, QuantizedWeight
from jgptq.quantizers import uniform


class MatrixPlan(NamedTuple):
    """How one matrix is quantized: ``method`` (``"gptq"`` or ``"rtn"``) and ``quant`` (its grid, or its GGML
    format in ``quant.format``); ``routed``: a stack of routed experts, whose GPTQ solve needs the MoE token
    threshold (:meth:`jgptq.config.MoEConfig.threshold`; other matrices fall back only when never reached).
    Hashable: matrices of one shape and one plan form a bucket."""

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
    """

    name: str
    weight: jax.Array
    hessian: Optional[jax.Array]
    tokens: Sequence[int]
    hessian_key: str = ""
    importance: Optional[object] = None


_FIGURES = ("loss", "damp_used", "damp_stage", "fallback", "dead_columns")
_ARRAYS = ("codes", "scales", "zeros", "g_idx", "perm", "payload")


@dataclasses.dataclass
class Solved:
    """What :func:`quantize_bucket` made of one :class:`Stack` (leading axis n everywhere).

    Attributes:
      weight: float32 jax (n, R, C), the dequantized weights (the decode of ``payload`` for GGML formats).
      plan: the :class:`MatrixPlan`.
      method, reason: per matrix, ``"gptq"`` or ``"rtn"`` and why rtn (empty when not a fallback).
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

    def figures(self) -> dict:
        """Plain-Python per-matrix figures (lists of n): method, reason and the solver's figures."""
        out = {k: np.asarray(getattr(self, k)).tolist() for k in _FIGURES}
        return {"method": list(self.method), "reason": list(self.reason), **out}


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


def quantize_bucket(stacks: Sequence[Stack], plan: MatrixPlan, *, threshold: int = 1, devices=None) -> list:
    """Quantizes every matrix of same-shape ``stacks`` under one ``plan`` in one batched call.

    Args:
      stacks: :class:`Stack` s of one (R, C) shape; N matrices in all.
      plan: the :class:`MatrixPlan` of every matrix of the bucket.
      threshold: fewest calibration tokens for a GPTQ solve (``method="gptq"``); below it, the fallback above.
      devices: JAX devices for the solve (default: every local device).
    Returns:
      One :class:`Solved` per stack, in order; the bytes are the same whatever the devices.
    Raises:
      ValueError: shapes that disagree, NaN/Inf in a weight, a Hessian or an importance vector (the solver's
        checks; a NaN/Inf Hessian means NaN/Inf calibration activations), a width the grid or format does not
        divide.
    """
    shapes = {tuple(s.weight.shape[1:]) for s in stacks}
    if len(shapes) != 1:
        raise ValueError(f"quantize_bucket: stacks of different shapes {sorted(shapes)} "
                         f"({', '.join(s.name for s in stacks)})")
    rows, cols = shapes.pop()
    tokens = [int(t) for s in stacks for t in s.tokens]
    low = [plan.method == "gptq" and t < threshold for t in tokens]
    reasons = [f"{t} tokens < {threshold}" if is_low else "" for t, is_low in zip(tokens, low)]
    weights = stacks[0].weight if len(stacks) == 1 else jnp.concatenate([s.weight for s in stacks])
    quant, ggml = plan.quant, plan.quant.is_ggml
    importance = None
    if ggml and stacks[0].importance is not None:
        importance = jnp.concatenate([jnp.asarray(s.importance, jnp.float32) for s in stacks])
    fields: dict = {}
    kept_plain = [False] * len(tokens)
    if plan.method == "rtn" and ggml:
        fields["payload"], fields["weight"] = parallel.encode_experts(plain_encoder(quant.format), weights,
                                                                      importance)
    elif plan.method == "rtn":
        fields.update(_rtn(weights, quant))
    else:
        hessians = _bucket_hessians(stacks, low, cols)
        names = ", ".join(s.name for s in stacks)
        name = f"{names} ({rows}x{cols})"
        if ggml:
            res, losses = _gptq_or_plain(weights, hessians, importance, quant, name, devices)
            plain_won = np.asarray(losses.plain < losses.gptq) & ~np.asarray(low)
            for i in np.flatnonzero(plain_won):
                reasons[i] = f"{PLAIN_KEPT}: plain {float(losses.plain[i]):.4g} < gptq {float(losses.gptq[i]):.4g}"
            kept_plain = plain_won.tolist()
        else:
            res = parallel.solve_experts(weights, hessians, quant, name=name, devices=devices, importance=importance)
        fields.update({k: getattr(res, k) for k in ("weight",) + _FIGURES + _ARRAYS})
        if ggml and any(low):  # too few tokens: the plain encode (the kept plain encodes are already in place)
            plain, _ = parallel.encode_experts(plain_encoder(quant.format), weights, importance)
            mask = jnp.asarray(low)[:, None, None, None]
            fields["payload"] = jnp.where(mask, jax.device_put(plain, _device(res.payload)), res.payload)
    n = len(tokens)
    if ggml:  # the weight is the decode of the kept bytes, exactly as GGMLWeight.dequantize
        from jgptq.ggml.api import decode

        fields["weight"] = decode(fields["payload"].reshape(n, rows, -1), quant.format)
        for k in ("codes", "scales", "zeros", "g_idx", "perm"):
            fields[k] = None
    for k, empty in (("loss", np.nan), ("damp_used", np.nan), ("damp_stage", -1), ("fallback", False),
                     ("dead_columns", 0)):
        fields[k] = np.full(n, empty) if fields.get(k) is None else np.asarray(fields[k])
    not_gptq = [a or b for a, b in zip(low, kept_plain)]
    fields["loss"] = np.where(np.asarray(not_gptq), np.nan, fields["loss"])  # no GPTQ loss where it was not kept
    out, start = [], 0
    for s in stacks:
        sl = slice(start, start + s.weight.shape[0])
        whole = len(stacks) == 1
        part = {k: None if v is None else v if whole else v[sl] for k, v in fields.items()}
        methods = tuple("rtn" if plan.method == "rtn" or not_gptq[i] else "gptq" for i in range(sl.start, sl.stop))
        out.append(Solved(plan=plan, method=methods, reason=tuple(reasons[sl]), **part))
        start = sl.stop
    return out


def _device(x):
    return next(iter(x.devices()))


PLAIN_KEPT = "lower loss"   # the reason of a matrix whose plain encode scored below its GPTQ solve


class Losses(NamedTuple):
    """float32 (N,) Hessian-weighted losses ``trace((W - Q) H (W - Q)^T)`` of the GPTQ result and of the plain
    encode of every matrix of a GGML bucket."""

    gptq: np.ndarray
    plain: np.ndarray


@dataclasses.dataclass(frozen=True)
class _GPTQOrPlain:
    """The per-matrix program of a GGML GPTQ bucket: the GPTQ solve and the plain encode, each scored by
    :func:`hessian_loss` on the matrix's Hessian; the GPTQ result with the plain encode's bytes and weight where
    those score strictly lower, and both losses (hashable: compiled programs are cached per config)."""

    config: QuantConfig

    def __call__(self, weight, hessian, importance):
        res = gptq.solve_unchecked(weight, hessian, importance, self.config)
        payload, decoded = plain_encoder(self.config.format)(weight, importance)
        loss_gptq = hessian_loss(weight, res.weight, hessian)
        loss_plain = hessian_loss(weight, decoded, hessian)
        plain = loss_plain < loss_gptq
        return res._replace(payload=jnp.where(plain, payload, res.payload),
                            weight=jnp.where(plain, decoded, res.weight)), loss_gptq, loss_plain


def _gptq_or_plain(weights, hessians, importance, quant: QuantConfig, name: str, devices):
    """The GGML GPTQ solve of a bucket with the plain-encode guard, over the devices: (GPTQResult with the kept
    bytes, :class:`Losses`)."""
    gptq.check_inputs(weights, hessians, importance, quant, name, batched=True)
    h_axis = None if hessians.ndim == 2 else 0
    i_axis = None if importance is None or importance.ndim == 1 else 0
    res, loss_gptq, loss_plain = parallel.map_experts(_GPTQOrPlain(quant), (weights, hessians, importance),
                                                      (0, h_axis, i_axis), devices=devices)
    return res, Losses(np.asarray(loss_gptq), np.asarray(loss_plain))


@functools.partial(jax.jit, static_argnames=("config",))
def _rtn(weights, config):
    codes, grid, deq = jax.vmap(lambda w: uniform.round_to_nearest(w.astype(jnp.float32), config))(weights)
    n, _, c = weights.shape
    gs = c if config.group_size == -1 else config.group_size
    g_idx = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32) // gs, (n, c))
    perm = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (n, c))
    return {"weight": deq, "codes": codes, "scales": grid.scale, "zeros": grid.zero, "g_idx": g_idx, "perm": perm}


@jax.jit
def _identity_where(hessians, mask):
    eye = jnp.eye(hessians.shape[-1], dtype=jnp.float32)
    return jnp.where(mask[:, None, None], eye, hessians.astype(jnp.float32))


def _bucket_hessians(stacks, low, cols):
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
