"""The solve step of the layerwise pipeline: one batched call per shape bucket of a decoder layer.

A :class:`Part` is a stack of same-shape matrices with their Hessians: one linear module (a stack of one), or
every expert's gate/up (or down) projection of an experts module. Expert parts of equal (rows, columns) form a
bucket, and so do linear parts; a bucket is solved by a single :func:`solve_bucket` call:

- Hessians shared by every matrix of the bucket (a tie: gate/up of a dense MLP, or all experts' gate/up under
  ``all_experts`` calibration) are passed once, as a (C, C) matrix, so the factorization is shared too;
- a matrix whose Hessian saw fewer tokens than its threshold (an expert rarely or never routed to) gets the
  identity as its Hessian, for which GPTQ is exactly round-to-nearest; it is reported as ``rtn`` with the reason;
- ``method="rtn"`` skips GPTQ and rounds every matrix to nearest on the same grids (a baseline); with a GGML
  format it is a plain encode with importance (llama.cpp's imatrix-only quantization), done where the weight is.

GGML formats: a part carries its format (per-weight mixes put parts of one shape but different formats in
different buckets) and its importance (N, C); the solver's payload bytes are kept, and the weight written back is
the decode of those bytes.

:func:`solve_bucket` is the one place a solve happens: the multi-device solver (same signature plus
``devices=``) replaces its body.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np


from interop.dlpack import to_torch
from jgptq import gptq, parallel
from jgptq.config import QuantConfig
from jgptq.quantizers import uniform

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Part:
    """A stack of N same-shape matrices of one layer.

    Attributes:
      name: qualified module/parameter name (for messages and the report).
      kind: ``"linear"``, ``"expert_gate_up"`` or ``"expert_down"``.
      weight: jax (N, R, C) in nn.Linear orientation (any float dtype).
      hessian: jax (C, C) shared by the N matrices, (N, C, C), or None (never fed: every matrix falls back).
      tokens: N token counts; threshold: fewest tokens for GPTQ.
      hkey: name of the Hessian (equal names = the same Hessian).
      param, module, transposed: where the result goes (checkpoint lookup name; the nn.Linear or 3-D Parameter;
        whether the parameter stores (E, in, out)).
      format: the GGML format of this part (``""``: the run's integer grids).
      importance: float32 (N, C) per-column importance for GGML encoders, or None.
    """

    name: str
    kind: str
    weight: jax.Array
    hessian: Optional[jax.Array]
    tokens: list
    threshold: int
    hkey: str
    param: str = ""
    module: object = None
    transposed: bool = False
    format: str = ""
    importance: object = None


class PartResult(NamedTuple):
    """Results of a part with the leading axis N (fields as :class:`jgptq.gptq.GPTQResult`): ``weight`` a float32
    torch tensor (sharing the solver's output buffer); ``loss``, ``damp_used``, ``damp_stage``, ``fallback`` and
    ``dead_columns`` numpy arrays; ``codes``, ``scales``, ``zeros``, ``g_idx``, ``perm`` and ``payload`` arrays on
    the device (``np.asarray`` brings them to host memory); plus the method and the fallback reason of each matrix."""

    weight: object
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    g_idx: np.ndarray
    perm: np.ndarray
    loss: np.ndarray
    damp_used: np.ndarray
    damp_stage: np.ndarray
    fallback: np.ndarray
    dead_columns: np.ndarray
    payload: object
    method: list
    reason: list
    format: str = ""


def solve_bucket(weights, hessians, config: QuantConfig, *, name: str = "experts", devices=None, importance=None):
    """Solves a stack of same-shape matrices over ``devices`` (default: every local device), with the room check
    of :func:`jgptq.parallel.solve_experts`; the bytes equal a one-device :func:`jgptq.gptq.solve_experts`."""
    return parallel.solve_experts(weights, hessians, config, name=name, devices=devices, importance=importance)


@functools.lru_cache(maxsize=None)
def ggml_encoder(format_name: str):
    """``fn(weight (R, C), importance (C,) or None) -> (payload uint8 (R, C // block, type_size), decoded float32
    (R, C))``: the plain encode of a GGML format (one function object per format, so compiles are cached)."""
    from jgptq.ggml import get_format

    fmt = get_format(format_name)

    def encode(weight, importance):
        w = weight.astype(jnp.float32)
        payload = fmt.encode(w) if importance is None else fmt.encode(w, importance.astype(jnp.float32))
        return payload.reshape(w.shape[0], -1, fmt.type_size), fmt.decode(payload)

    return encode


def _device(x):
    return next(iter(x.devices()))


def _encode_bucket(group, weights, importance, format_name: str):
    """Plain GGML encodes of a bucket: (payload (N, R, nb, ts), dequantized (N, R, C)); experts spread over the
    devices, linear modules encoded on the device that holds them."""
    fn = ggml_encoder(format_name)
    if group[0].kind != "linear":
        return parallel.encode_experts(fn, weights, importance)
    named = {str(i): p.weight[0] for i, p in enumerate(group)}
    imp = None if importance is None else {str(i): importance[i] for i in range(len(group))}
    out = parallel.encode_on_devices(fn, named, imp)
    pay = jnp.stack([jax.device_put(out[str(i)][0], jax.devices()[0]) for i in range(len(group))])
    deq = jnp.stack([jax.device_put(out[str(i)][1], jax.devices()[0]) for i in range(len(group))])
    return pay, deq


@functools.partial(jax.jit, static_argnames=("config",))
def _rtn(weights, config):
    codes, grid, deq = jax.vmap(lambda w: uniform.round_to_nearest(w.astype(jnp.float32), config))(weights)
    n, _, c = weights.shape
    gs = c if config.group_size == -1 else config.group_size
    g_idx = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32) // gs, (n, c))
    perm = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (n, c))
    nan = jnp.full((n,), jnp.nan, jnp.float32)
    return gptq.GPTQResult(deq, nan, perm, g_idx, codes, grid.scale, grid.zero, None, nan,
                           jnp.full((n,), -1, jnp.int32), jnp.zeros((n,), bool), jnp.zeros((n,), jnp.int32))


def _encoded_result(payload, deq):
    n, _, c = deq.shape
    nan = jnp.full((n,), jnp.nan, jnp.float32)
    zeros_c = jnp.zeros((n, c), jnp.int32)
    return gptq.GPTQResult(deq, nan, jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (n, c)), zeros_c, None,
                           None, None, payload, nan, jnp.full((n,), -1, jnp.int32), jnp.zeros((n,), bool),
                           jnp.zeros((n,), jnp.int32))


@jax.jit
def _identity_where(hessians, mask):
    eye = jnp.eye(hessians.shape[-1], dtype=jnp.float32)
    return jnp.where(mask[:, None, None], eye, hessians.astype(jnp.float32))


def _bucket_hessians(parts, low):
    """(C, C) when every matrix shares one Hessian and none falls back, else (N, C, C) with identities."""
    c = parts[0].weight.shape[-1]
    keys = {p.hkey for p in parts}
    shared = len(keys) == 1 and all(p.hessian is None or p.hessian.ndim == 2 for p in parts)
    if shared and not any(low):
        return next(p.hessian for p in parts)
    if shared and all(low):
        return jnp.eye(c, dtype=jnp.float32)
    pieces = []
    for p in parts:
        n = p.weight.shape[0]
        h = p.hessian if p.hessian is not None else jnp.zeros((c, c), jnp.float32)
        pieces.append(jnp.broadcast_to(h, (n, c, c)) if h.ndim == 2 else h)
    if len(pieces) == 1 and pieces[0].ndim == 3 and not any(low) and pieces[0].dtype == jnp.float32:
        return pieces[0]
    stacked = pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)
    return _identity_where(stacked, jnp.asarray(low))


_SMALL = ("loss", "damp_used", "damp_stage", "fallback", "dead_columns")


def _warm_on(devices) -> bool:
    """Whether solves are compiled ahead (:func:`warm_solves`): on accelerators, where a layer's programs take
    seconds to compile; on the CPU the calibration already has every core."""
    return (devices or jax.devices())[0].platform != "cpu"


def _jax_dtype(dtype):
    return jnp.dtype(str(dtype).replace("torch.", ""))


def solve_shapes(target) -> set:
    """The buckets a layer with targets ``target`` is solved in: (experts?, rows, columns) of its matrices."""
    shapes = {(False, m.out_features, m.in_features) for m in target.linears.values()}
    for _, lay in target.experts.values():
        shapes |= {(True, lay.up_rows, lay.hidden), (True, lay.hidden, lay.inter)}
    return shapes


def warm_solves(target, cfg, *, devices=None) -> Optional[threading.Thread]:
    """Starts compiling, on a background thread, the solve programs that :func:`solve_layer` will run for a layer
    with targets ``target`` (:func:`interop.models.layer_targets`), so that the first layer's compiles overlap its
    calibration (XLA compiles without holding Python's lock). Returns the thread (join it before solving, so
    that nothing compiles twice), or None when nothing is to be compiled (round-to-nearest, GGML formats).

    Which matrices share a Hessian is known only after the calibration forward; a bucket of several linear
    modules is compiled for both cases. A guess that misses costs background compile time, never a result.
    """
    if cfg.method != "gptq" or cfg.quant.is_ggml or not _warm_on(devices):
        return None
    sds = jax.ShapeDtypeStruct
    buckets: dict = {}
    for m in target.linears.values():
        w = m.weight
        buckets.setdefault((False, w.shape[0], w.shape[1]), []).append((1, _jax_dtype(w.dtype), "own"))
    for module, lay in target.experts.values():
        up = getattr(module, lay.up_name)
        up_tie = "shared" if cfg.moe.calibration == "all_experts" else "own"
        for rows, cols, tie in ((lay.up_rows, lay.hidden, up_tie), (lay.hidden, lay.inter, "own")):
            buckets.setdefault((True, rows, cols), []).append((lay.num_experts, _jax_dtype(up.dtype), tie))
    jobs = []
    for (expert, rows, cols), members in buckets.items():
        n, dtype = sum(m[0] for m in members), members[0][1]
        weights = sds((n, rows, cols), dtype)
        if expert:
            shapes = [(cols, cols)] if members[0][2] == "shared" and len(members) == 1 else [(n, cols, cols)]
        else:
            shapes = [(cols, cols)] + ([(n, cols, cols)] if len(members) > 1 else [])
        jobs += [(weights, sds(h, jnp.float32)) for h in shapes]

    def compile_all():
        for weights, hessians in jobs:
            try:
                parallel.plan_solve(weights, hessians, cfg.quant, devices=devices)
            except Exception as exc:  # noqa: BLE001 - a warm-up only: the solve compiles what it needs
                log.debug("warming a solve program for %s failed: %s", weights.shape, exc)

    thread = threading.Thread(target=compile_all, name="jgptq-warm-solves", daemon=True)
    thread.start()
    return thread


def solve_layer(parts: list, cfg, *, devices=None) -> list:
    """Solves every part of a layer, one call per bucket (experts or linear, rows, columns); returns
    [(part, PartResult)]."""
    buckets: dict = {}
    for p in parts:
        # experts and linear modules apart: each kind then has the same buckets in every layer of a kind, so the
        # compiled solves are reused from layer to layer
        buckets.setdefault((p.kind != "linear",) + tuple(p.weight.shape[1:]) + (p.format,), []).append(p)
    out = []
    for shape in sorted(buckets):
        group = buckets[shape]
        low, reasons = [], []
        for p in group:
            for t in p.tokens:
                is_low = cfg.method == "gptq" and t < p.threshold
                low.append(is_low)
                reasons.append(f"{t} tokens < {p.threshold}" if is_low else "")
        weights = group[0].weight if len(group) == 1 else jnp.concatenate([p.weight for p in group])
        fmt = shape[3]
        quant = cfg.quant.replace(format=fmt) if fmt else cfg.quant
        importance = None
        if fmt and group[0].importance is not None:
            importance = jnp.concatenate([jnp.asarray(p.importance, jnp.float32) for p in group])
        if cfg.method == "rtn" and fmt:
            res = _encoded_result(*_encode_bucket(group, weights, importance, fmt))
        elif cfg.method == "rtn":
            res = _rtn(weights, cfg.quant)
        else:
            hess = _bucket_hessians(group, low)
            names = ", ".join(p.name for p in group)
            # the solver checks shapes and finiteness; a NaN/Inf Hessian means NaN/Inf calibration activations
            res = solve_bucket(weights, hess, quant, name=f"{names} ({shape[1]}x{shape[2]})", devices=devices,
                               importance=importance)
            if fmt and any(low):
                # under-calibrated matrices get exactly the plain encode (an identity Hessian is not quite that for
                # formats whose importance weighting looks at the whole row: q4_0, q4_1, q5_0, q5_1)
                plain, _ = _encode_bucket(group, weights, importance, fmt)
                mask = jnp.asarray(low)[:, None, None, None]
                res = res._replace(payload=jnp.where(mask, jax.device_put(plain, _device(res.payload)),
                                                     res.payload))
        if fmt:  # the written-back weight is the decode of the kept bytes, exactly as GGMLWeight.dequantize
            from jgptq.ggml.api import decode

            n, r, c = weights.shape
            res = res._replace(weight=decode(res.payload.reshape(n, r, -1), fmt))
        weight = to_torch(res.weight, name=group[0].name)
        # the per-matrix figures come to host memory now; codes, scales and payloads stay on the device until
        # their records are made (on the pipeline's store thread)
        host = {f: None if getattr(res, f) is None else
                (np.asarray(getattr(res, f)) if f in _SMALL else getattr(res, f))
                for f in PartResult._fields[1:-4] + ("payload",)}
        host["loss"] = np.where(np.asarray(low), np.nan, host["loss"])  # no GPTQ loss for fallbacks
        start = 0
        for p in group:
            n = p.weight.shape[0]
            sl = slice(start, start + n)
            method = ["rtn" if (cfg.method == "rtn" or low[start + e]) else "gptq" for e in range(n)]
            whole = len(group) == 1
            out.append((p, PartResult(weight[sl], **{f: None if a is None else a if whole else a[sl]
                                                     for f, a in host.items()},
                                      method=method, reason=reasons[sl], format=fmt)))
            start += n
    return out
