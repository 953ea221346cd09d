"""The importance statistic (imatrix) of every weight in the layerwise pipeline, and the importance the GGML
encoders get from it (which format each weight gets is :mod:`jgptq.plan`'s decision).

- :func:`layer_imatrix`: the statistic of one calibrated layer by model parameter name
  (:class:`jgptq.imatrix.ImatrixEntry`: per expert, routed tokens only), of a chunk of its experts
  (:func:`span_entries` takes a chunk's rows of a whole layer's);
- :func:`check_imatrix`: a user-given statistic checked against every target weight before any work.

The per-column importance handed to the encoders is made from it with the solve's inputs
(:func:`jgptq_torch.pipeline.solve.importance_of`).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jgptq.imatrix import ImatrixEntry


def target_weights(prefix: str, layer_idx: int, target):
    """(model parameter name, input columns, stacked matrices E or None) of every matrix of a layer's targets."""
    base = f"{prefix}.{layer_idx}"
    return [(m.param_name(base), m.cols, m.experts) for m in target.matrices()]


def check_imatrix(given: Mapping, prefix: str, targets: list) -> None:
    """Checks a user-given imatrix (parameter name -> ImatrixEntry) against every target weight, before any work.

    Raises:
      ValueError: a missing weight, or an entry of the wrong shape.
    """
    for i, t in enumerate(targets):
        for param, cols, experts in target_weights(prefix, i, t):
            entry = given.get(param)
            if entry is None:
                raise ValueError(f"imatrix: no entry for {param} (entries are keyed by model parameter name, as "
                                 f"QuantizeResult.imatrix is)")
            sums = np.asarray(entry.sums)
            want = (experts or 1, cols)
            if sums.reshape(-1, sums.shape[-1]).shape != want or np.asarray(entry.counts).size != want[0]:
                raise ValueError(f"imatrix: entry {param} has sums {sums.shape} and counts "
                                 f"{np.asarray(entry.counts).shape}; expected sums {want} and counts ({want[0]},)")


def expert_rows(m, span) -> tuple:
    """(lo, hi): the experts of matrix ``m`` (a :class:`jgptq_torch.models.Matrix`) in ``span`` (every one when
    ``span`` is None or ``m`` is a linear module's)."""
    if span is None or m.layout is None:
        return 0, m.count
    return min(span[0], m.count), min(span[1], m.count)


def layer_imatrix(collector, prefix: str, layer_idx: int, target, span=None) -> dict:
    """The importance statistic of a calibrated layer: model parameter name -> :class:`ImatrixEntry` (an expert
    or a module never reached has zero sums and a zero count). With ``span`` (lo, hi), the collector's, experts
    stacks have the entries of experts lo..hi-1 only."""
    out = {}
    base = f"{prefix}.{layer_idx}"
    for m in target.matrices():
        lo, hi = expert_rows(m, span)
        key = collector.tie.get(m.hessian_key) if m.layout is None else m.hessian_key
        got = None if key is None else collector.importance_statistic(key)
        if got is None:
            got = (np.zeros((hi - lo, m.cols), np.float32), np.zeros((hi - lo,), np.float32))
        out[m.param_name(base)] = ImatrixEntry(*got)
    return out


def span_entries(entries: Mapping, prefix: str, layer_idx: int, target, span) -> dict:
    """The entries of a layer's ``target`` weights in ``entries`` (a whole layer's, e.g. a given imatrix), of
    experts ``span`` (lo, hi) only for experts stacks; ``entries`` itself when ``span`` is None."""
    if span is None:
        return entries
    out, base = {}, f"{prefix}.{layer_idx}"
    for m in target.matrices():
        entry, (lo, hi) = entries[m.param_name(base)], expert_rows(m, span)
        if m.layout is not None:
            sums, counts = np.asarray(entry.sums), np.asarray(entry.counts)
            entry = ImatrixEntry(sums.reshape(-1, sums.shape[-1])[lo:hi], counts.reshape(-1)[lo:hi])
        out[m.param_name(base)] = entry
    return out


def pass_statistics(run, step) -> tuple:
    """What one calibrated pass of layer ``step.index`` leaves beside its solve: (its collector's importance
    entries, :func:`layer_imatrix`; the entries its solve weighs with: the run's given imatrix or a hook's
    (``step.imatrix``) when there is one, else its own). With ``keep_hessians``, the pass's Hessians go to the
    result (:func:`keep_hessians`)."""
    i, collector, span, target = step.index, step.collector, step.span, step.target
    if run.cfg.keep_hessians:
        keep_hessians(run.result.hessians, i, collector, span)
    own = layer_imatrix(collector, run.prefix, i, target, span)
    given = run.given if run.given is not None else step.imatrix
    return own, (own if given is None else span_entries(given, run.prefix, i, target, span))


def keep_hessians(kept: dict, i: int, collector, span) -> None:
    """``keep_hessians``: the Hessians of layer ``i``'s pass of ``span`` into ``kept`` ((layer, key) -> (Hessian,
    token counts)). A whole layer's as they are; a chunk's in host memory (numpy), an experts stack's per-expert
    Hessians joined to the earlier chunks', one shared by every expert or a linear module's taken once."""
    for key in collector.states:
        h, tokens = collector.hessian(key)
        have = kept.get((i, key))
        if span is None:
            kept[(i, key)] = (h, tokens)
        elif have is None:
            kept[(i, key)] = (np.asarray(h), tokens)
        elif isinstance(tokens, list):
            kept[(i, key)] = (np.concatenate([have[0], np.asarray(h)]), have[1] + tokens)


def layer_entries(imatrix: Mapping, prefix: str, layer_idx: int, target) -> dict:
    """The entries of ``imatrix`` that belong to the weights of one layer."""
    return {p: imatrix[p] for p, _, _ in target_weights(prefix, layer_idx, target) if p in imatrix}

