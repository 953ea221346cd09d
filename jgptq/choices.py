"""What a ``target_bpw`` run may choose for each matrix: one question, answered before any work.

The torch side describes every decoder-layer target as a :class:`Sized` matrix (its :class:`jgptq.plan.Target`
and the shape of its stack) and asks :func:`layout` once. The answer (:class:`Choices`) holds, for every matrix
that a ``formats`` or ``exclude`` rule holds, its format and exact size; for every other matrix its candidate
formats (:func:`jgptq.allocate.candidates`), each with its exact size in bits (:func:`jgptq.allocate.tensor_bits`)
and the :class:`jgptq.bucket.MatrixPlan` that :func:`jgptq.plan.plan_matrix` makes with that candidate; and the
weights the budget is counted over. Pure Python; nothing here measures anything.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from jgptq import allocate, plan
from jgptq.surface import option


class Sized(NamedTuple):
    """A matrix as the budget sees it: its :class:`jgptq.plan.Target` and ``count`` stacked (``rows``,
    ``target.cols``) matrices (experts of one projection; 1 for a linear module)."""

    target: plan.Target
    rows: int
    count: int


class Choices(NamedTuple):
    """The answer of :func:`layout`: ``fixed`` (param -> (format or ``"float"``, bits): the matrices a rule
    holds; ``"int<bits>"`` on an integer grid), ``free`` (param -> {format: (bits, :class:`MatrixPlan`)}, in the
    order of :func:`jgptq.allocate.candidates`) and ``weights`` (int: of every matrix, fixed ones included)."""

    fixed: dict
    free: dict
    weights: int


def layout(config, matrices: Iterable[Sized], n_layers: int, n_expert: int) -> Choices:
    """The :class:`Choices` of a ``target_bpw`` run under ``config`` (:class:`jgptq.config.PipelineConfig`) over
    ``matrices`` (:class:`Sized`, of a model of ``n_layers`` decoder layers with at most ``n_expert`` experts per
    layer).

    Raises:
      ValueError: a matrix free of every rule that no candidate format fits; a width the plan refuses
        (:func:`jgptq.plan.plan_matrix`).
    """
    fixed, free, weights = {}, {}, 0
    for target, rows, count in matrices:
        weights += count * rows * target.cols
        held = _held_format(config, target, n_layers, n_expert)
        names = (held,) if held is not None else allocate.candidates(config, target.cols)
        if not names:
            offered = ", ".join(config.target_formats) or "the default family"
            raise ValueError(f"{target.param}: no candidate format of target_bpw ({offered}) fits its {target.cols} "
                             f"input columns; give it a format with {option('formats')} or leave it unquantized "
                             f"with {option('exclude')}")
        bits = {f: allocate.tensor_bits(f, rows, target.cols, count, config.quant) for f in names}
        if held is not None:
            fixed[target.param] = (held, bits[held])
        else:
            free[target.param] = {f: (bits[f], plan.plan_matrix(config, target, n_layers, 0, candidate=f)[0])
                                  for f in names}
    return Choices(fixed, free, weights)


def _held_format(config, target: plan.Target, n_layers: int, n_expert: int):
    """The format of a matrix that a ``formats`` or ``exclude`` rule holds (``"float"`` when excluded,
    ``"int<bits>"`` on an integer grid), or None when no rule does."""
    if plan.first_rule(config, target.name) is None:
        return None
    held, _ = plan.plan_matrix(config, target._replace(routed=False), n_layers, n_expert)
    return "float" if held is None else (held.format if held.quant.is_ggml else f"int{held.quant.bits}")
