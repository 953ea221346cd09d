"""The plan of a run: every quantization decision for every matrix, resolved once, before any work.

A run's per-weight policy is one ordered list of rules (:func:`rules`): the ``exclude`` patterns (leave a weight in
floating point), then the ``formats`` rules (a GGML format per weight), matched with ``re.search`` against the
weight's name relative to its decoder layer (``self_attn.v_proj``, ``mlp.experts.down_proj``); the first match
wins. A weight no rule matches gets its entry of the ``assignment`` (the formats a ``target_bpw`` run chose,
:mod:`jgptq.allocate`), else the ``mix`` preset's choice (:mod:`jgptq.mixes`), else ``quant.format``. Then its
width is checked against its grid or format, with the ``block_fallback`` for GGML rows that are not a whole number
of blocks.

:func:`plan_matrix` is the one function that decides a matrix's method and format; :func:`resolve` applies it to
every target of a model and reports the rules that matched nothing. Adding a format or a method changes this
module and :mod:`jgptq.bucket`, nothing on the torch side.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple, Optional

from jgptq import mixes
from jgptq.bucket import MatrixPlan
from jgptq.surface import on_command_line, option
from jgptq.solve_inputs import width_misfit


class Rule(NamedTuple):
    """One per-weight rule: ``pattern`` (a regex searched in the weight's name relative to its layer) and what a
    match means: ``skip`` (leave in floating point) or a GGML ``format``. ``origin`` is the config field it came
    from (for messages)."""

    pattern: str
    format: Optional[str] = None
    skip: bool = False
    origin: str = "formats"


class Target(NamedTuple):
    """What planning needs to know of a matrix: ``name`` relative to its decoder layer, its ``layer`` index, its
    input columns ``cols``, ``param``, the model parameter name (for messages and as the plan's key), and
    ``routed``: a stack of routed experts (the MoE token threshold applies to its solve)."""

    name: str
    layer: int
    cols: int
    param: str
    routed: bool = False


class Plan(NamedTuple):
    """The resolved plan of a model: ``matrices`` (model parameter name -> :class:`MatrixPlan`), ``skipped``
    (parameter name -> the rule that excluded it), ``notes`` (fallbacks chosen, for the report) and
    ``unmatched`` (rules that matched no weight, as messages)."""

    matrices: dict
    skipped: dict
    notes: list
    unmatched: list


def rules(config) -> tuple:
    """The ordered :class:`Rule` s of a :class:`jgptq.config.PipelineConfig`: exclusions first, then formats."""
    return (tuple(Rule(p, skip=True, origin="exclude") for p in config.exclude)
            + tuple(Rule(p, format=f) for p, f in config.formats))


def first_rule(config, name: str) -> Optional[Rule]:
    """The first rule of ``config`` whose pattern is found in ``name``, or None."""
    return next((r for r in rules(config) if re.search(r.pattern, name)), None)


def format_of(config, name: str, layer: int, n_layers: int, n_expert: int, param: str = "", n_gqa: int = 1,
              down_index=None) -> str:
    """The format a GGML run gives weight ``name`` (model parameter ``param``) of decoder layer ``layer`` before
    any block fallback: the first matching ``formats`` rule, else its ``assignment`` entry, else the ``mix``
    preset's choice (``n_gqa``: query heads per key-value head; ``down_index``: an ffn_down weight's place in
    llama.cpp's count, :func:`jgptq.mixes.ffn_down_order`), else ``quant.format``."""
    rule = next((r for r in rules(config) if not r.skip and re.search(r.pattern, name)), None)
    if rule is not None:
        return rule.format
    if config.assignment:
        assigned = dict(config.assignment).get(param)
        if assigned is not None:
            return assigned
    if config.mix is not None:
        return mixes.preset_format(config.mix, name, layer, n_layers, n_expert, n_gqa, down_index)
    return config.quant.format


def plan_matrix(config, target: Target, n_layers: int, n_expert: int, n_gqa: int = 1, *,
                candidate: Optional[str] = None, down_index: int | None = None) -> tuple:
    """The method and format of one matrix: the single place this is decided.

    Args:
      config: the run's :class:`jgptq.config.PipelineConfig`.
      target: the matrix.
      n_layers, n_expert: decoder layers of the model and the largest expert count of a layer (the mixes'
        layer patterns and llama.cpp's 8-expert rule); n_gqa: query heads per key-value head (the mixes' attn_v).
      candidate: a format to plan the matrix with in place of its ``formats`` rule, ``assignment`` entry or mix
        choice (a GGML name, or ``"int<bits>"`` in an integer-grid run): what the ``target_bpw`` measurement
        tries. An ``exclude`` rule still wins.
      down_index: an ffn_down matrix's place in llama.cpp's count of them (:func:`jgptq.mixes.ffn_down_order`;
        None: its layer).
    Returns:
      (:class:`MatrixPlan` or None when a rule excludes it, a fallback note or None).
    Raises:
      ValueError: a width that the group size does not divide, or a GGML row that is not a whole number of its
        format's blocks with no usable ``block_fallback``.
    """
    rule = first_rule(config, target.name)
    if rule is not None and rule.skip:
        return None, None
    quant, note = config.quant, None
    if quant.is_ggml:
        fmt = candidate or format_of(config, target.name, target.layer, n_layers, n_expert, target.param, n_gqa,
                                     down_index)
        fmt, note = _fit_block(config, target, fmt)
        if fmt != quant.format:
            quant = quant.replace(format=fmt)
        return MatrixPlan(config.method, quant, target.routed), note
    from jgptq.allocate import int_bits_of

    bits = int_bits_of(candidate or dict(config.assignment).get(target.param, ""))
    if bits is not None and bits != quant.bits:
        quant = quant.replace(bits=bits)
    misfit = width_misfit(quant, target.cols)
    if misfit:
        raise ValueError(f"{target.param.removesuffix('.weight')}: {misfit} (exclude it with exclude=[...] or "
                         f"choose another group_size)")
    return MatrixPlan(config.method, quant, target.routed), note


def _fit_block(config, target: Target, fmt: str) -> tuple:
    from jgptq.ggml import get_format

    block = get_format(fmt).block_size
    if target.cols % block == 0:
        return fmt, None
    fallback = config.block_fallback
    if fallback == "llama.cpp":
        fallback = mixes.LLAMA_FALLBACK.get(fmt, "error")
    if fallback == "error" or target.cols % get_format(fallback).block_size:
        raise ValueError(
            f"{target.param}: {target.cols} input columns are not a multiple of the {fmt} block size {block}"
            + ("" if fallback == "error" else f", nor of the fallback {fallback}'s")
            + f"; choose another format for it with {option('formats')}, a fallback with "
              f"{option('block_fallback')}, or leave it unquantized with {option('exclude')}")
    named = option("block_fallback", config.block_fallback) if on_command_line() else "block_fallback"
    return fallback, (f"{target.param}: {target.cols} input columns are not a multiple of the {fmt} block size "
                      f"{block}; {fallback} used instead ({named})")


def resolve(config, targets: Iterable[Target], n_layers: int, n_expert: int, n_gqa: int = 1) -> Plan:
    """The :class:`Plan` of every target of a model (:func:`plan_matrix` for each), with the rules of
    ``config`` that matched no target reported in ``unmatched``."""
    matrices, skipped, notes, used = {}, {}, [], set()
    all_rules = rules(config)
    targets = list(targets)
    downs = mixes.ffn_down_order([(t.name, t.layer) for t in targets])
    for t in targets:
        used |= {r for r in all_rules if re.search(r.pattern, t.name)}
        plan, note = plan_matrix(config, t, n_layers, n_expert, n_gqa, down_index=downs.get((t.name, t.layer)))
        if plan is None:
            skipped[t.param] = first_rule(config, t.name)
        else:
            matrices[t.param] = plan
        if note:
            notes.append(note)
    unmatched = [f"{r.origin} rule {r.pattern!r} matched no weight" for r in all_rules if r not in used]
    return Plan(matrices, skipped, notes, unmatched)


def edge_formats(config, cols: int, tied: bool, dominant: str = None) -> dict:
    """The formats of the token embedding and the output head of a GGML run, as llama.cpp's quantizer chooses
    them for the run's file type (:func:`jgptq.mixes.edge_format`); the pipeline itself quantizes neither.

    Args:
      config: the run's :class:`jgptq.config.PipelineConfig`.
      cols: the row length of both (the hidden size).
      tied: the model has no separate head (the embedding then gets the head's rule; ``"output"`` is left out).
      dominant: the GGML format holding most of the run's quantized weights. A run without a mix is named by
        it, as llama.cpp names a file by its main type (and as ``general.file_type`` is written), and its edges
        follow that type's rules; it differs from ``config.quant.format`` where tensors were given formats one by
        one (``target_bpw``, ``assignment``: there ``config.quant.format`` is only the first candidate).
    Returns:
      ``{"token_embd": format or None, "output": format or None}`` (None: floating point); empty for an
      integer-grid run.
    """
    if not config.quant.is_ggml:
        return {}
    fmt = dominant if config.mix is None and dominant is not None else config.quant.format
    base = mixes.PRESETS[config.mix] if config.mix is not None else fmt
    ftype = mixes.file_type(config.mix, fmt)
    out = {"token_embd": mixes.edge_format(ftype, base, "token_embd", cols, tied)}
    if not tied:
        out["output"] = mixes.edge_format(ftype, base, "output", cols)
    return out
