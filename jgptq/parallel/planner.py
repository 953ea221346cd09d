"""Planning a map over experts on a mesh: how many experts per device, at which ``lax.map`` batch, in how many
chunks, so that the compiled program fits each device's free memory (:func:`plan`; :mod:`jgptq.parallel.engine`
runs the plan).

Room check (:func:`plan`): a device's program for m experts at batch k needs ``fixed_k + m * io`` bytes, where
``io`` is one expert's inputs + outputs and ``fixed_k`` the rest (temporaries of one lax.map step, loop state),
read from ``memory_analysis()`` of the compiled program for two steps (lowered from ShapeDtypeStructs, nothing
allocated; k > 2 is extrapolated from k = 1, 2), plus, on accelerators, a runtime slack of ``2 * io`` per vmap
lane and 1 MiB for the library workspaces allocated at run time, which the analysis does not see
(:func:`runtime_slack`; ``benchmarks/room_check.py`` measures the bound). A device takes work if it has room
for one expert alone. The plan takes the largest m that fits at that k on every working device; when experts
are left over, they run in chunks of ``devices x m`` (balanced, padded with copies of a real expert whose
results are dropped). The compiled program of the chosen (m, k) is checked itself before it runs; if its
predicted peak does not fit, m (then k) shrinks. When no device has room for one expert, MemoryError is raised
before anything runs. Under a limit, a program compiled earlier for the same per-expert shapes is run again when
it fits and pads little (:func:`_compiled_fit`): no probe or new program is compiled for each bucket whose free
bytes or expert count differ a little. A fitting program is not reused when it takes more than
:data:`REUSE_STEPS` times the sequential steps of a fresh plan for the room at hand, estimated from the compiled
programs' peaks (a narrow probe compiled while memory was short is not kept once there is room again).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional, Sequence

import jax

from jgptq.parallel import memory
from jgptq.parallel.programs import _Spec, compiled_peaks, expert_mesh, io_bytes, program_peak

log = logging.getLogger("jgptq.parallel")

# Largest lax.map batch tried by default. CPU: 1, since batched LAPACK calls inside shard_map on several virtual
# CPU devices can deadlock the intra-op thread pool (on one CPU device a wider batch does solve faster, about 1.5-2x
# for 8 experts of 1024 x 512 at width 8, but its bytes are not always those of width 1). Accelerators:
# every expert of a device at once when memory allows (the per-column steps are latency bound, so a wider vmap is
# nearly free), falling back to smaller batches when it does not, but not to 1 while a device has two experts.
MAX_BATCH = {"cpu": 1}
MAX_BATCH_DEFAULT = 256


@dataclasses.dataclass(frozen=True)
class Plan:
    """How ``num_experts`` experts are spread: the same for every process of a multi-host run.

    Attributes:
      devices: devices that take work, in mesh order; expert ``i`` of chunk ``c`` goes to
        ``devices[(i - c * chunk) // per_device]``.
      per_device: experts per device per chunk (a multiple of ``batch_size``).
      batch_size: experts vmapped together inside a device's ``lax.map`` (1: the unbatched program).
      num_experts: real experts (padding excluded).
      num_chunks: successive runs, each over ``len(devices) * per_device`` expert slots.
      predicted_peak: per-device peak bytes of the chosen program (from its compiled memory analysis).
      free: dict device -> free bytes seen when planning (:data:`memory.UNLIMITED` when unbounded).
      idle: devices given no work: without room for one expert, or not needed for this many experts.
    """

    devices: tuple
    per_device: int
    batch_size: int
    num_experts: int
    num_chunks: int
    predicted_peak: int
    free: dict = dataclasses.field(compare=False, repr=False)
    idle: tuple = ()

    @property
    def chunk(self) -> int:
        return len(self.devices) * self.per_device

    def chunk_range(self, c: int) -> tuple[int, int]:
        return c * self.chunk, min(self.num_experts, (c + 1) * self.chunk)

    def device_of(self, expert: int):
        """The device that solves expert ``expert``."""
        return self.devices[(expert % self.chunk) // self.per_device]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _balanced(num_experts: int, n_devices: int, most: int, k: int) -> tuple[int, int]:
    """(chunks, experts per device) when ``n_devices`` devices take at most ``most`` experts each at batch ``k``:
    the fewest chunks, the experts spread evenly over them (per device a multiple of ``k``)."""
    chunks = -(-num_experts // (n_devices * most))
    return chunks, _round_up(-(-num_experts // (chunks * n_devices)), k)


def _width(k_max: int, per_device: int, num_experts: int, platform: str) -> int:
    """The preferred vmap width: the experts per device up to ``k_max``; on accelerators at least 2 for E >= 2."""
    k = min(k_max, per_device)
    if platform != "cpu" and k_max >= 2 and num_experts >= 2:
        k = max(k, 2)
    return k


def plan(spec: _Spec, num_experts: int, devices: Sequence, *, batch_size: Optional[int] = None,
         memory_limit=None, reserve=0, gather_bytes: Optional[dict] = None) -> Plan:
    """Chooses devices, experts per device, lax.map batch and chunks that fit in memory (see module docstring).

    Args:
      spec: the per-expert function and its argument avals.
      num_experts: E >= 1.
      devices: candidate devices (global devices in a multi-process run; every process passes the same list).
      batch_size: None (largest that fits, up to the platform default) or an upper bound.
      memory_limit, reserve: see :func:`memory.free_bytes`.
      gather_bytes: bytes the gathered results will take on a device (reserved there up front), or a function
        that gives them, called once the first program is compiled (its outputs give their size without a trace).
    """
    from jgptq.parallel import multihost

    if num_experts < 1:
        raise ValueError(f"no experts to solve (num_experts={num_experts})")
    devices = list(devices)
    free = multihost.free_bytes_everywhere(devices, memory_limit, reserve)
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"devices of one platform only, got {sorted(platforms)}")
    k_max = MAX_BATCH.get(devices[0].platform, MAX_BATCH_DEFAULT) if batch_size is None else int(batch_size)
    if k_max < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    me = jax.process_index()
    one_dev = expert_mesh([next((d for d in devices if d.process_index == me), devices[0])])
    limited = any(free[d] < memory.UNLIMITED for d in devices)

    if limited and jax.process_count() == 1:   # processes must agree on a plan; their compile caches may not
        reused = _compiled_fit(spec, num_experts, devices, free, k_max, gather_bytes)
        if reused is not None:
            return reused

    # Fast path: the whole bucket in one step on every device. Compiling a GPTQ program takes seconds on a GPU, so
    # the common case (it fits) compiles exactly the program that then runs, and nothing else.
    target = -(-num_experts // len(devices))
    k0 = _width(k_max, target, num_experts, devices[0].platform)
    per_dev0 = _round_up(target, k0)
    used0 = tuple(devices[:-(-num_experts // per_dev0)])
    peak0 = program_peak(spec, expert_mesh(used0), per_dev0, k0)
    free = _less_gathered(free, gather_bytes)
    io = io_bytes(spec)
    if all(peak0 <= free[d] for d in used0):
        if k0 > 1 and len(used0) > 1 and used0[0].platform == "cpu":
            log.warning("a lax.map batch of %d on several CPU devices runs batched LAPACK calls inside shard_map, "
                        "which can deadlock XLA:CPU's thread pool; batch_size=1 is the safe choice on CPU", k0)
        return Plan(used0, per_dev0, k0, num_experts, 1, peak0, free, tuple(devices[len(used0):]))

    @functools.lru_cache(maxsize=None)
    def peak_of(m, k):  # compiled peak of one device running m experts at batch k
        return program_peak(spec, one_dev, m, k)

    def fixed(k):  # bytes beyond the experts' inputs and outputs, from a two-step program (k > 2: extrapolated)
        if k <= 2:
            return peak_of(2 * k, k) - 2 * k * io
        return fixed(2) + (k - 2) * max(fixed(2) - fixed(1), 0)

    def capacity(d, k):  # most experts (a multiple of k) device d holds at batch k
        if free[d] >= memory.UNLIMITED:
            return memory.UNLIMITED
        if free[d] < peak_of(1, 1):
            return 0
        m = max(free[d] - fixed(k), 0) // io // k * k
        if m >= 2 * k:
            return m
        if k > 2:                                    # a single step, estimated (the chosen program is checked)
            return k if m >= k else 0
        return k if free[d] >= peak_of(k, k) else 0

    working = [d for d in devices if not limited or capacity(d, 1) >= 1]
    if not working:
        raise MemoryError(f"no device has room for one expert: one needs {peak_of(1, 1)} bytes, the most free on "
                          f"a device is {max(free.values())} bytes ({len(devices)} devices)"
                          f"{memory.limit_note(devices, memory_limit)}")
    idle = tuple(d for d in devices if d not in working)
    if idle:
        log.warning("devices without room for one expert take no work: %s", [str(d) for d in idle])
    target = -(-num_experts // len(working))
    k0 = _width(k_max, target, num_experts, devices[0].platform)
    batches = sorted({c for c in (k0, 128, 64, 32, 16, 8, 4, 2) if 2 <= c <= k0}, reverse=True) + [1]
    bi = next(i for i, c in enumerate(batches) if all(capacity(d, c) >= c for d in working))
    for _ in range(32):
        k = batches[bi]
        per_dev = min(min(capacity(d, k) for d in working), _round_up(target, k))
        chunks, per_dev = _balanced(num_experts, len(working), per_dev, k)
        n_used = -(-num_experts // (chunks * per_dev))
        used = tuple(working[:n_used])
        peak = program_peak(spec, expert_mesh(used), per_dev, k)
        if all(peak <= free[d] for d in used):
            break
        log.info("the program for %d experts per device (batch %d) needs %d bytes: shrinking", per_dev, k, peak)
        if per_dev > k:
            target = per_dev - k
        elif bi + 1 < len(batches):
            bi += 1
        else:
            raise MemoryError(f"the program for one expert per device needs {peak} bytes, more than the free "
                              f"{min(free[d] for d in used)} bytes")
    else:  # pragma: no cover - every step shrinks
        raise MemoryError("no chunking of the experts fits the devices' free memory")
    if k > 1 and len(used) > 1 and used[0].platform == "cpu":
        log.warning("a lax.map batch of %d on several CPU devices runs batched LAPACK calls inside shard_map, "
                    "which can deadlock XLA:CPU's thread pool; batch_size=1 is the safe choice on CPU", k)
    if k < k0:
        log.info("memory holds %d experts per device at once, not %d: the solve runs at batch %d", k, k0, k)
    if k == 1 and num_experts > 1 and used[0].platform != "cpu":
        log.warning("memory holds one expert per device at once: the unbatched program runs, whose bytes may "
                    "differ in the last bits from a batched run of the same experts")
    if chunks > 1:
        log.info("%d experts in %d chunks of %d devices x %d (batch %d); predicted peak %d bytes per device",
                 num_experts, chunks, len(used), per_dev, k, peak)
    return Plan(used, per_dev, k, num_experts, chunks, peak, free, idle + tuple(working[n_used:]))


def _less_gathered(free: dict, gather_bytes) -> dict:
    """``free`` less the bytes the gathered results will take on their device (``gather_bytes``: a mapping, a
    function that gives one, or None); unlimited devices stay unlimited."""
    room = dict(free)
    for d, b in ((gather_bytes() if callable(gather_bytes) else gather_bytes) or {}).items():
        if d in room and room[d] < memory.UNLIMITED:
            room[d] = max(0, room[d] - b)
    return room


# Most expert slots a reused program may run for the experts it is given (the rest are padding): beyond this, a
# program compiled for the bucket's own count costs less than the padded solves.
REUSE_SLOTS = 1.5
# Most sequential steps a reused program may take against the estimate of a fresh plan for the room at hand: a
# narrow program compiled when memory was short (a probe) is not kept once the room holds a wider one.
REUSE_STEPS = 1.25


def _compiled_fit(spec: _Spec, num_experts: int, devices: Sequence, free: dict, k_max: int,
                  gather_bytes) -> Optional[Plan]:
    """A plan that runs a program of ``spec`` compiled earlier in this process, when one fits ``free`` (less the
    gathered results) with at most :data:`REUSE_SLOTS` slots per expert, else None. Under a memory limit the
    planner would otherwise compile probes and a new program whenever the free bytes or the expert count differ a
    little from the last bucket's (a chunked layer's 37 and 36 experts, the next layer's memory), each compile
    seconds on a GPU for the same solve. Among fitting programs: fewest sequential steps (chunks x batches a
    chunk), then the least padding."""
    peaks = compiled_peaks(spec)
    if not peaks:
        return None
    room = _less_gathered(free, gather_bytes)
    best = None
    for mesh, per_dev, k, peak in peaks:
        used = tuple(mesh.devices.flat)
        if (k > k_max or len(used) != min(len(devices), num_experts) or not set(used) <= set(devices)
                or any(peak > room[d] for d in used)):   # every device that could take work takes it
            continue
        chunks = -(-num_experts // (len(used) * per_dev))
        slots = chunks * len(used) * per_dev
        if slots > REUSE_SLOTS * num_experts or (k == 1 < num_experts and used[0].platform != "cpu"):
            continue
        score = (chunks * -(-per_dev // k), slots)   # sequential steps of the program, then the padding
        if best is None or score < best[0]:
            best = (score, Plan(used, per_dev, k, num_experts, chunks, peak, room,
                                tuple(d for d in devices if d not in used)))
    if best is None:
        return None
    fresh = _fresh_steps(peaks, io_bytes(spec), num_experts, best[1].devices, room, k_max)
    if fresh is not None and best[0][0] > REUSE_STEPS * fresh:
        log.info("the fitting compiled programs take %d steps for %d experts where the room holds a plan of about "
                 "%d: planning anew", best[0][0], num_experts, fresh)
        return None
    plan_ = best[1]
    log.info("%d experts run the compiled program for %d per device (batch %d) in %d chunks; predicted peak %d "
             "bytes per device", num_experts, plan_.per_device, plan_.batch_size, plan_.num_chunks,
             plan_.predicted_peak)
    return plan_


def _fresh_steps(peaks: list, io: int, num_experts: int, used: tuple, room: dict, k_max: int) -> Optional[int]:
    """Estimated sequential steps of a fresh plan on devices ``used`` with ``room``, at the batch widths of the
    compiled programs ``peaks`` (whose peaks give each width's bytes beyond the experts' inputs and outputs); None
    when no width has room for a batch."""
    fixed: dict = {}
    for _, per_dev, k, peak in peaks:
        fixed[k] = max(fixed.get(k, 0), peak - per_dev * io)
    least = min(room[d] for d in used)
    best = None
    for k, f in fixed.items():
        if k > k_max or (k == 1 < num_experts and used[0].platform != "cpu"):
            continue
        m = min(max(least - f, 0) // max(io, 1) // k * k, _round_up(-(-num_experts // len(used)), k))
        if m < k:
            continue
        chunks, per_dev = _balanced(num_experts, len(used), m, k)
        steps = chunks * per_dev // k
        best = steps if best is None else min(best, steps)
    return best
