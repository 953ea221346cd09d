"""Several processes (hosts): start-up, agreeing on free memory, gathering results, sharing inputs.

A multi-process run is SPMD: every process calls the same jgptq functions with the same arguments, in the same
order. ``jax.devices()`` then lists the devices of every process; each process places and solves only the experts
of its own devices (its addressable ones) and the results are gathered as numpy arrays on every process (the
process that owns the torch model uses them, the others may drop them).

- :func:`initialize` wraps ``jax.distributed.initialize``; call it before any other JAX call.
- :func:`free_bytes_everywhere`: each process reads its own devices' free memory, then all processes exchange
  the figures, so every process makes the same plan.
- :func:`allgather`: a global array (leading axis sharded over devices of several processes) as one numpy array
  on every process, one device's shard at a time (no device ever holds more than one shard extra).
- :func:`share_from_owner`: inputs that only one process has (the torch model's owner) broadcast to all.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from jgptq.parallel import memory


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, *, local_device_ids=None, **kwargs) -> None:
    """Joins a multi-process JAX run (``jax.distributed.initialize``); call before any other JAX call.

    Args:
      coordinator_address: ``"host:port"`` of process 0's coordinator service (every process passes the same).
      num_processes: number of processes in the run.
      process_id: this process's index, 0..num_processes-1 (process 0 hosts the coordinator).
      local_device_ids: devices of this host that this process uses (e.g. one process per GPU).
    On a cluster manager JAX understands (SLURM, Open MPI, Kubernetes, Cloud TPU) the three may be left None.
    """
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids, **kwargs)


def free_bytes_everywhere(devices, memory_limit=None, reserve=0) -> dict:
    """:func:`memory.free_bytes` of ``devices``, including other processes' devices (a collective call)."""
    devices = list(devices)
    me = jax.process_index()
    local = [d for d in devices if d.process_index == me]
    free_local = memory.free_bytes(local, memory_limit, reserve) if local else {}
    if jax.process_count() == 1:
        return free_local
    from jax.experimental import multihost_utils

    # int32 halves: JAX without x64 would truncate int64 bytes.
    table = np.zeros((len(devices), 2), np.int32)
    for i, d in enumerate(devices):
        if d in free_local:
            v = min(free_local[d], memory.UNLIMITED - 1)
            table[i] = (v >> 31, v & 0x7FFFFFFF)
    every = np.asarray(multihost_utils.process_allgather(table))        # (processes, devices, 2)
    owner = np.array([d.process_index for d in devices])
    rows = every[owner, np.arange(len(devices))].astype(np.int64)
    values = [int(rows[i, 0]) << 31 | int(rows[i, 1]) for i in range(len(devices))]
    return {d: memory.UNLIMITED if v >= memory.UNLIMITED - 1 else v for d, v in zip(devices, values)}


def allgather(x: jax.Array) -> np.ndarray:
    """A global array sharded on its leading axis, as one numpy array on every process (a collective call).

    Shards are broadcast one device at a time from the process that holds them, so a device never holds more
    than one extra shard; the result is assembled in host memory.
    """
    if x.is_fully_addressable:
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    me = jax.process_index()
    shards = {s.device: s for s in x.addressable_shards}
    seen = set()
    for dev, index in sorted(x.sharding.devices_indices_map(x.shape).items(), key=lambda kv: kv[0].id):
        key = tuple((sl.start, sl.stop) for sl in index)
        if key in seen:   # a replicated shard already gathered
            continue
        seen.add(key)
        shape = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, x.shape))
        mine = dev.process_index == me
        piece = np.asarray(shards[dev].data) if mine else np.zeros(shape, x.dtype)
        out[index] = _broadcast_bytes(piece, mine)
    return out


def _broadcast_bytes(piece: np.ndarray, is_source: bool) -> np.ndarray:
    """Broadcasts the raw bytes of ``piece`` (a sum with zeros on floats would turn -0.0 into +0.0)."""
    from jax.experimental import multihost_utils

    piece = np.ascontiguousarray(piece)
    raw = piece.reshape(-1).view(np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(raw, is_source=is_source), np.uint8)
    return got.view(piece.dtype).reshape(piece.shape)


def share_from_owner(tree, owner: int = 0):
    """``tree`` (numpy/jax arrays) of process ``owner``, returned as numpy on every process (a collective call).

    Every process passes a tree of the same structure, shapes and dtypes (non-owners: e.g. zeros or
    ``np.empty``); only the owner's values are used. Costs one broadcast of the whole tree.
    """
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    mine = jax.process_index() == owner
    return jax.tree.map(lambda a: _broadcast_bytes(np.asarray(a), mine), tree)
