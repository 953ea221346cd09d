"""The routed experts' accumulation programs compiled ahead, on worker threads, while the first layer calibrates.

A forward's routed rows are added a group of experts at a time (:mod:`jgptq_torch.pipeline.routed_groups`); each
distinct (slots g, rows per slot p, columns C) compiles one program (:func:`jgptq.statistics.update_group`), and
which ones a forward meets depends on where the router sends its tokens, so layers after the first still met new
ones. On an accelerator the layout is bounded (:func:`jgptq_torch.pipeline.routed_groups.layout_shapes`), so every
program a run can meet is known from the model before any work: :func:`group_jobs` lists them for a layer's
targets, likeliest first, and :class:`jgptq_torch.pipeline.hooks.WarmUp` hands them to a
:class:`jgptq_torch.pipeline.solve.Warming` that runs beside the calibration and the solve, across layers. The
calibration never compiles one twice: a program under way on a worker is waited for
(:func:`jgptq.statistics.compile_groups`), one not started yet is compiled by the calibration and then skipped.
"""

from __future__ import annotations

import functools

import jax
import torch

from jgptq import statistics as stats
from jgptq_torch.dlpack import to_jax
from jgptq_torch.pipeline import routed_groups

MAX_GROUP_PROGRAMS = 64   # at most this many compiled ahead a run: every shape one chain of statistics meets at a
                          # 128-expert layer's two parts (61 for Qwen3-235B's widths, 8 row levels x up to 4 slot
                          # counts each); past it, the rarer shapes of further chains (a router-weighted Hessian
                          # apart from the importance, the paired statistic) cost host cores the solve's compiles
                          # share, for shapes a calibration may never meet: the calibration compiles those it meets
WORKERS = 4               # threads of the group warm-up (beside the solve warm-up's, which end with layer 0's solve)


def group_keys(target, span, chain: dict, dtype) -> set:
    """What decides a layer's group programs: (experts, kept experts, columns, part) of each routed experts
    matrix, with the chain's names and the rows' torch ``dtype``. A layer whose keys were all warmed before
    meets no program not listed then."""
    kept = None if span is None else span[1] - span[0]
    return {(m.count, min(m.count, kept or m.count), m.cols, m.kind, tuple(chain), str(dtype))
            for m in target.matrices() if m.kind in ("expert_gate_up", "expert_down", "expert_stack")}


def group_jobs(target, span, chain: dict, dtype, device: torch.device, tokens: int, top_k=None,
               limit: int = MAX_GROUP_PROGRAMS) -> list:
    """(what, compile function) for the routed experts' group programs of a layer with targets ``target``
    (:class:`jgptq_torch.models.LayerTargets`; ``span``: the kept experts (lo, hi), or None), likeliest first
    and at most ``limit``.

    Args:
      chain: the statistics the calibration collects (name -> :class:`jgptq.statistics.Statistic`,
        :func:`jgptq.statistics.of_config`); a chain with a statistic of every token (``all_experts``) adds its
        routed rows one expert at a time, and has no group programs.
      dtype: the torch dtype of the layer's activations; device: the run device (a torch device).
      tokens: tokens per calibration forward (B x S, padding included); top_k: experts per token, None if not
        known.
    Returns:
      [(description, function(devices=None))], each compiling one program through
      :func:`jgptq.statistics.compile_group` (skipped there when compiled already).
    """
    if any(s.all_experts for s in chain.values()):
        return []
    unpaired = [s for s in chain.values() if not s.paired]
    paired = [s for s in chain.values() if s.paired]
    x_tensor = torch.zeros((1, 1), dtype=dtype, device=device)
    x_aval, mask_aval = (_aval(to_jax(t)) for t in (x_tensor, x_tensor[:, 0] > 0))
    jax_device = next(iter(to_jax(x_tensor).devices()))
    element = x_tensor.element_size()
    ranked = []
    parts = sorted(group_keys(target, span, chain, dtype))
    for experts, kept, cols, kind, _, _ in parts:
        for statistics, width in ((unpaired, cols), (paired, 2 * cols)):
            for members in _by_power(statistics):
                shapes = routed_groups.layout_shapes(experts, kept, width * element, tokens,
                                                     None if top_k is None else tokens * top_k)
                avals = tuple(_state_aval(s, cols, kept, jax_device) for s in members)
                x = jax.ShapeDtypeStruct((1, width), x_aval.dtype, sharding=x_aval.sharding)
                for rank, (g, p) in enumerate(shapes):
                    what = f"{kind} {experts} experts: {g} x {p} x {width}"
                    ranked.append((rank, len(ranked), what, functools.partial(_compile, members, avals, g, p, x,
                                                                              mask_aval)))
    return [(what, job) for _, _, what, job in sorted(ranked, key=lambda r: r[:2])[:limit]]


def _by_power(statistics: list) -> list:
    """The chain split as :func:`jgptq_torch.pipeline.routed_groups.add_grouped` updates routed rows with their
    routing weights: one update per distinct router power, in first-seen order."""
    powers: dict = {}
    for s in statistics:
        powers.setdefault(s.router_power, []).append(s)
    return list(powers.values())


def _aval(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)


def _state_aval(statistic, cols: int, kept: int, device):
    """The stacked state ``statistic.init(cols, kept, device)`` would give, as avals (nothing allocated)."""
    shapes = jax.eval_shape(lambda: statistic.init(cols, kept))
    placed = jax.device_put(jax.numpy.zeros((), jax.numpy.int32), device).sharding   # as init places its arrays
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), shapes)


def _compile(members, avals, g: int, p: int, x, mask, devices=None) -> None:
    stats.compile_group(members, avals, g, p, x, mask)


def tokens_per_forward(hidden: list) -> int:
    """The most tokens (B x S) of one calibration forward, ``hidden`` the layer's (B, S, H) inputs per batch."""
    return max((int(h.shape[0]) * int(h.shape[1]) for h in hidden), default=0)


def top_k_of(model):
    """Experts per token from the model's config (``num_experts_per_tok`` or ``moe_top_k``), None if it says
    none."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    for name in ("num_experts_per_tok", "moe_top_k", "top_k"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
