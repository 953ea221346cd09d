"""A layer's routed experts a chunk at a time: MoE layers larger than the device's working room.

When a layer's whole need is over the device budget (or, without one, an accelerator's free memory:
:func:`device_room`), the budget (:meth:`jgptq_torch.pipeline.budget.Budget.assess`) cuts its routed experts into
balanced chunks of consecutive experts, so that only one chunk's Hessians, solve and results are on the device at
a time.
"""

from __future__ import annotations

import torch

ROOM_SHARE = 0.9   # without a budget, chunks are planned against this share of an accelerator's free memory


def device_room(device: torch.device, on_device: int):
    """Without a budget: the bytes chunks of routed experts are planned against on ``device``, a CUDA device's
    free memory plus the ``on_device`` bytes of the model already there, less a tenth for what the estimate does
    not see; None elsewhere (no chunks on the CPU unless a budget asks)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(ROOM_SHARE * (free + on_device))
