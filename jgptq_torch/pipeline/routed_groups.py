"""Routed experts' input rows added to their stacked statistics a group of experts at a time.

A forward of an experts module hands :class:`jgptq_torch.pipeline.capture.Collector` every expert's rows at once,
sorted by expert. Adding them one expert at a time would cost one dispatch of the accumulation per expert; here
experts with about as many rows share padded blocks of slots (:func:`group_layout`) and each block is one call of
:func:`jgptq.statistics.update_group`. Rows are padded to a handful of sizes (:func:`padded_rows`) so that the
jitted accumulations compile for a few shapes only; padding never reaches a statistic (it is masked out).
"""

from __future__ import annotations

import torch

from jgptq import statistics as stats
from jgptq_torch.dlpack import to_jax

MAX_ROWS = 1 << 13
GROUP_BYTES = 1 << 30  # padded rows of one group of experts passed to the accumulation at once
PRODUCT_BYTES = 1 << 32  # float32 (cols x cols) products of one group's slots, made before they are summed in
PADDING_PRODUCTS = 1 << 34  # multiply-adds of padding slots a group may carry on an accelerator to spare a program


def padded_rows(n: int) -> int:
    """Rows a batch of ``n`` rows is padded to: a power of two from 64 to 8192, so that the jitted accumulation
    compiles for a handful of shapes only (padding rows are zero and masked out of the token count)."""
    return max(64, 1 << (max(n, 1) - 1).bit_length())


def accelerator(device: torch.device) -> bool:
    """Whether groups take the accelerator layout of :func:`group_layout` (any device but the CPU)."""
    return device.type != "cpu"


def _columns_at_most(bytes_per_row: int) -> int:
    """A bound on the columns C of rows of ``bytes_per_row`` bytes (elements of at least 2 bytes)."""
    return max(1, bytes_per_row // 2)


def _most_slots(p: int, bytes_per_row: int, cap: int) -> int:
    """The most slots of a group of ``p`` rows per slot: a power of two, at most ``cap``, whose padded rows stay
    within :data:`GROUP_BYTES` and whose float32 products (one (C, C) a slot, C the rows' width in elements of at
    least 2 bytes: bounded by ``(bytes_per_row / 2)^2`` x 4 B) within :data:`PRODUCT_BYTES`."""
    width = _columns_at_most(bytes_per_row)
    most = max(1, min(GROUP_BYTES // (p * bytes_per_row), PRODUCT_BYTES // (4 * width * width)))
    return min(cap, 1 << (most.bit_length() - 1))


def _least_slots(p: int, bytes_per_row: int, most: int) -> int:
    """The fewest slots of an accelerator group of ``p`` rows per slot whose level groups at most ``most``.

    Where ``most - 1`` padding slots cost at most :data:`PADDING_PRODUCTS` multiply-adds (``p`` x C^2 each, C
    bounded as in :func:`_most_slots`), every group of the level is padded to ``most``: one program for the level,
    about a millisecond of arithmetic a call against about a second a compile on a GPU (a model of 512-wide
    experts compiled 27 accumulation programs, 28 at most: 7 levels of 4 sizes). Wider experts are never padded so
    (at 2048 columns not even 64 rows per slot), and keep at least an eighth of ``most``."""
    width = _columns_at_most(bytes_per_row)
    return most if (most - 1) * p * width * width <= PADDING_PRODUCTS else max(1, most // 8)


def group_layout(counts: list, bytes_per_row: int, on_accelerator: bool, kept: int = None) -> list:
    """How a forward's routed experts are added: [(rows per slot p, experts of the slots, -1 for padding)].

    ``kept``: how many experts' statistics are kept (a chunk's; None: every one of ``counts``, the others' counts
    are 0); a group has at most its next power of two of slots, so that a chunk of a few experts of a wide layer
    is not padded to the slots of the whole layer (5 of DeepSeek-V3's 256 experts took 32 slots of 7168^2 float32
    products, 6.6 GB a group, before).

    Experts with the same :func:`padded_rows` share groups of at most :data:`GROUP_BYTES` of padded input and
    :data:`PRODUCT_BYTES` of float32 products (a power of two of slots: 16 slots of DeepSeek-V3's 7168^2, 64 of
    Qwen3-235B's 4096^2; a 64-slot group of 7168^2 products, 13 GB, ran an 80 GB GPU out of memory). Every slot is a full (p, C) x (p, C) product, padding slots included, and every
    distinct (slots, p, C) shape compiles one accumulation program; each call costs the host about a millisecond
    of dispatch, so groups are few and large. A level's last group is padded to the next power of two of its
    members; on an accelerator to at least an eighth of the level's largest group, which bounds the programs per
    level at four (padding every last group to the largest group wasted up to 125 slots' products a level), or to
    the largest group where that padding costs little (:func:`_least_slots`).
    """
    levels: dict = {}
    for e, n in enumerate(counts):
        if n:
            levels.setdefault(padded_rows(min(n, MAX_ROWS)), []).append(e)
    cap = 1 << (max(1, len(counts) if kept is None else kept) - 1).bit_length()
    groups = []
    for p, members in sorted(levels.items()):
        most = _most_slots(p, bytes_per_row, cap)
        least = _least_slots(p, bytes_per_row, most) if on_accelerator else 1
        for i in range(0, len(members), most):
            chunk = members[i:i + most]
            g = min(most, max(least, 1 << (len(chunk) - 1).bit_length()))
            groups.append((p, chunk + [-1] * (g - len(chunk))))
    return groups


def layout_shapes(experts: int, kept: int, bytes_per_row: int, tokens: int, routed_rows: int = None) -> list:
    """Every (slots g, rows per slot p) the accelerator layout of :func:`group_layout` can give for a forward of
    an experts module of ``experts`` experts, ``kept`` of them kept (a chunk's; the others' counts 0), rows of
    ``bytes_per_row`` bytes, at most ``tokens`` rows per expert (an expert sees a token once) and ``routed_rows``
    rows in all (tokens x top_k; None: not known, not used to bound), most likely first.

    The likeliest rows per slot are those nearest the mean rows per kept expert (``routed_rows / experts``); a
    level's members number at most ``routed_rows // (p / 2 + 1)`` (each holds more than p / 2 rows, p > 64). At
    the likeliest level the larger groups come first (most experts are there), elsewhere the smaller ones.
    Returns:
      [(g, p)] ints, each once.
    """
    if kept < 1 or tokens < 1:
        return []
    cap = 1 << (kept - 1).bit_length()
    top = padded_rows(min(tokens, MAX_ROWS))
    mean = padded_rows(max(1, (routed_rows or tokens) // experts))
    levels = []
    p = 64
    while p <= top:
        members = kept if routed_rows is None else min(kept, routed_rows // (p // 2 + 1) if p > 64 else routed_rows)
        if members:
            most = _most_slots(p, bytes_per_row, cap)
            least = _least_slots(p, bytes_per_row, most)
            sizes = sorted({min(most, max(least, 1 << (m - 1).bit_length()))
                            for m in _chunk_sizes(members, most)}, reverse=p == mean)
            levels.append((abs(p.bit_length() - mean.bit_length()), p, sizes))
        p *= 2
    return [(g, p) for _, p, sizes in sorted(levels) for g in sizes]


def _chunk_sizes(members: int, most: int) -> range:
    """The members a level's group can hold (its last group fewer than ``most``), up to ``members``."""
    return range(1, min(members, most) + 1)


def add_grouped(chain: list, states: list, rows, counts: list, keep, kept: tuple, name: str, weights=None):
    """The ``states`` of the statistics of ``chain`` ([(name, Statistic)]; a state None: not fed yet) after
    adding the routed ``rows``; None when no kept expert has a row (nothing added).

    Experts with about as many rows are padded to the same rows per slot and added together, one group of slots
    per call (:func:`group_layout`); an expert with more than :data:`MAX_ROWS` rows is added in passes.
    ``rows`` are sorted by expert (``counts[e]`` each); ``keep``: the rows' padding mask or None; ``kept``: (lo,
    hi), the experts whose statistics are kept (entries ``e - lo``). A group's padded block is one gather of
    ``rows`` at computed positions (padding positions read any row and are masked out), so that packing needs no
    device synchronization beyond one small copy of the group layout per call. Statistics with a
    ``router_power`` get the block times ``weights ** (router_power / 2)`` (computed in float32, handed on in the
    rows' dtype), one update per distinct power.
    """
    c, dev = rows.shape[-1], rows.device
    lo, hi = kept
    n_exp = len(counts)
    starts = [0] * n_exp
    for e in range(1, n_exp):
        starts[e] = starts[e - 1] + counts[e - 1]
    groups = group_layout([n if lo <= e < hi else 0 for e, n in enumerate(counts)], c * rows.element_size(),
                          accelerator(dev), kept=hi - lo)
    if not groups:
        return None
    # the layout of every group (first row, rows) in one small host-to-device copy
    layout = torch.tensor([[starts[e], counts[e]] if e >= 0 else [0, 0] for _, slots in groups for e in slots],
                          dtype=torch.long)
    layout = layout.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else layout.to(dev)
    states = list(states)
    powers: dict = {}                       # router power -> positions in the chain
    for j, (_, statistic) in enumerate(chain):
        powers.setdefault(statistic.router_power if weights is not None else 0.0, []).append(j)
    scales = {pw: weights.float().pow(pw / 2) for pw in powers if pw}
    at, shapes = 0, [(len(slots), p) for p, slots in groups]
    for p, slots in groups:
        g = len(slots)
        first, size = layout[at:at + g, 0, None], layout[at:at + g, 1, None]
        at += g
        span = torch.arange(p, device=dev)
        index = [(e if e >= 0 else slots[0]) - lo for e in slots]  # padding slots add nothing
        for offset in range(0, max(counts[e] for e in slots if e >= 0), p):
            valid = (offset + span) < size                                   # (g, p)
            idx = torch.where(valid, first + offset + span, 0)
            padded = rows[idx]
            mask = valid if keep is None else valid & keep[idx]
            mj = to_jax(mask, name=name + " mask")
            for pw, members in powers.items():
                block = (padded.float() * scales[pw][idx, None]).to(rows.dtype) if pw else padded
                xj = to_jax(block, name=name)
                for j in members:
                    if states[j] is None:
                        cols = c // 2 if chain[j][1].paired else c
                        states[j] = chain[j][1].init(cols, hi - lo, next(iter(xj.devices())))
                members_chain = [chain[j][1] for j in members]
                if shapes:   # this call's new group shapes compiled side by side, once per power
                    stats.compile_groups(members_chain, [states[j] for j in members], shapes, xj, mj)
                got = stats.update_group(members_chain, [states[j] for j in members], index, xj, mj, name=name)
                for j, state in zip(members, got):
                    states[j] = state
            shapes = None
    return states
