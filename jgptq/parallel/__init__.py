"""Experts spread over every device, and over hosts: sharding, room check, same bytes on any mesh.

How work is split
-----------------
Experts of one shape (a "bucket": every ``gate``/``up``/``down`` of a layer, or any dict of named weights
grouped by :func:`bucket_by_shape`) are solved together. The devices that take part form a 1-D
``jax.sharding.Mesh`` with the axis ``"expert"``; the experts are cut into consecutive runs, one run per device
(expert i on device i // m within a chunk), each placed straight on its device (no copy of the whole stack on one
device). One jitted ``jax.shard_map`` program runs on every device at once; inside it, ``lax.map`` walks the
device's experts, one at a time (batch 1: the unbatched solve) or ``vmap``-ed k at a time. The program has no
collective: devices never talk while solving. Results are gathered back in input order (to one device, to the
host, or, across hosts, to every process); experts added to even out the last chunk are copies of a real one,
and their results are dropped.

Before anything runs, a room check sizes the work from the compiled program's ``memory_analysis()`` (lowered
from shapes alone, nothing allocated) against each device's free memory (``bytes_limit - bytes_in_use``; CPU is
unlimited unless a limit is simulated with ``memory_limit=`` or ``JGPTQ_DEVICE_MEMORY_LIMIT``). Devices without
room for one expert take no work; the plan takes the largest batch k and then the most experts per device that
fit; when the bucket does not fit at once it runs in balanced chunks. The chosen program's own analysis is
checked before it runs, so an out-of-memory error cannot happen where a smaller chunk fits. The estimate is XLA's
plus, on accelerators, a slack for workspaces allocated at run time that the analysis does not see
(:func:`~jgptq.parallel.engine.runtime_slack`: 2 x one expert's inputs and outputs per vmap lane + 1 MiB);
allocator fragmentation is not in it, hence ``reserve=``. Hessian partials accumulated where the activations
lived are merged onto the device that will solve the expert (:func:`merge_partials`).

Same bytes on any mesh. A result depends on the inputs and the configuration only, not on the number of
devices, chunks or the batch: every device runs the same per-expert program. Two things are pinned down for this
on XLA:CPU: (1) a ``jnp.sum`` reduces in a different order in a batched and an unbatched program, so the GPTQ
loss is summed by a fixed pairwise tree; (2) a ``vmap`` of width 1 is compiled to other matmul kernels (the unit
batch axis is stripped and the block update fused with its transposes), so the engine never runs one: batch 1 is
the unbatched program and larger batches divide the per-device count evenly. Tests check bytes for 1, 2, 4 and 8
simulated devices and two processes. GPUs run different kernels than CPUs, so GPU and CPU bytes differ. On a GPU
the unbatched program also compiles to other kernels than batched ones, so there a bucket of two or more experts
never runs unbatched (a device's experts are padded to two); that batched widths and chunkings give the same
bytes on a GPU is measured (``benchmarks/batch_invariance.py``, README "Several devices and hosts"), not
guaranteed by construction. The width stays the experts per device, because the column loop is latency bound
and a narrower vmap is slower. Programs are compiled with cuBLAS GEMMs on GPUs (:mod:`jgptq.xla_options`).

On one CPU host, simulated devices (``--xla_force_host_platform_device_count``) are a test vehicle, not a
speed-up: their runtimes share the cores and XLA:CPU's thread pool (``benchmarks/parallel_overhead.py`` measures
the scheduling cost). Spread CPU work over processes or hosts instead. A lax.map batch above 1 on several CPU
devices can also deadlock XLA:CPU (batched LAPACK calls inside shard_map), which is why the default batch on CPU
is 1.

The imatrix-only path (no GPTQ: a plain encode of each weight with its importance) uses the same engine
(:func:`encode_experts`), or encodes each weight on the device where it already lives, every device at once
(:func:`encode_on_devices`).

Multi-host runs
---------------
jgptq runs SPMD over several processes (one per host, or one per GPU) through ``jax.distributed``: every process
runs the same script with the same arguments; each solves the experts of its own devices; results are gathered
as numpy arrays on every process, and the process that owns the torch model writes them back.

1. Start every process with the same coordinator address (host and a free port of process 0), the number of
   processes, and its own index, and call :func:`initialize` before any other JAX call::

       import jgptq.parallel as jp
       jp.initialize("10.0.0.1:8476", num_processes=2, process_id=int(os.environ["RANK"]))
       result = jp.solve_experts(weights, hessians, config)   # numpy on every process

   e.g. ``RANK=0 python quantize.py &`` on host A and ``RANK=1 python quantize.py`` on host B. Under SLURM,
   Open MPI or Kubernetes, ``jp.initialize()`` without arguments reads them from the environment.
2. GPUs: one process per host sees all of that host's GPUs (or pass ``local_device_ids`` for one process per
   GPU); collectives go through NCCL. CPUs: collectives go through gloo (the default CPU collectives of
   jax >= 0.10); ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives each process N CPU devices.
3. Every process must pass inputs of the same shapes. If only the torch model's owner has them,
   :func:`share_from_owner` broadcasts them first (every host then holds a copy).

Files: :mod:`~jgptq.parallel.engine` (mesh, plan, program, placement, gather), :mod:`~jgptq.parallel.memory`
(free memory, simulated limits, compiled peaks), :mod:`~jgptq.parallel.experts` (GPTQ and encode entry points),
:mod:`~jgptq.parallel.multihost` (processes).
"""

from jgptq.parallel.engine import Plan, expert_mesh, map_experts
from jgptq.parallel.experts import (bucket_by_shape, encode_experts, encode_on_devices, merge_partials, plan_solve,
                                    solve_experts, solve_named)
from jgptq.parallel.memory import free_bytes, program_peak
from jgptq.parallel.multihost import initialize, share_from_owner

__all__ = ["Plan", "bucket_by_shape", "encode_experts", "encode_on_devices", "expert_mesh", "free_bytes",
           "initialize", "map_experts", "merge_partials", "plan_solve", "program_peak", "share_from_owner",
           "solve_experts", "solve_named"]
