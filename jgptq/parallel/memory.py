"""Device memory: what is free on each device, and what a compiled program needs at its peak.

- :func:`free_bytes` reads ``memory_stats()`` (``bytes_limit - bytes_in_use``). CPU devices return no statistics:
  they count as unlimited unless a limit is simulated, in which case the bytes in use are the sum of the live
  JAX arrays on the device.
- A per-device limit can be simulated for tests and for sharing a device with another framework: the
  ``memory_limit`` argument (bytes, or a mapping device -> bytes); else the limit of the innermost
  :func:`granted` block (a caller that shares the device, e.g. the torch pipeline, grants the solves the room its
  plan left them); else the environment variable ``JGPTQ_DEVICE_MEMORY_LIMIT`` (bytes, with an optional
  ``K``/``M``/``G`` suffix, powers of 1024). A limit never raises what a device really has.
- :func:`program_peak` is the per-device peak of a compiled program from its ``memory_analysis()`` (nothing is
  allocated): ``peak_memory_in_bytes`` where the backend reports it, else arguments + outputs - aliased + temps.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
import os
from typing import Mapping, Optional, Union

import jax

UNLIMITED = 1 << 62
ENV_LIMIT = "JGPTQ_DEVICE_MEMORY_LIMIT"
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

Limit = Union[None, int, str, Mapping]
_GRANTED: contextvars.ContextVar = contextvars.ContextVar("jgptq_granted_memory", default=None)


@contextlib.contextmanager
def granted(limit: Limit):
    """Within the block (this thread or task), every room check that passes no ``memory_limit`` plans against
    ``limit`` (bytes, ``"40G"``, or a mapping device -> bytes; None: no limit of its own, the environment's).

    For a caller that shares a device with JAX and knows what it leaves to it: JAX's statistics count only JAX's
    own buffers, so without it a solve sizes its chunks to the whole of JAX's allocator limit, whatever the other
    framework holds on the same device."""
    token = _GRANTED.set(limit)
    try:
        yield
    finally:
        _GRANTED.reset(token)


def parse_bytes(text) -> int:
    """``"512M"`` -> 536870912; plain integers pass through. Raises ValueError naming the rule."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
        unit = s[-1:] if s[-1:] in _SUFFIX and s[-1:] else ""
        try:
            value = int(float(s[: len(s) - len(unit)]) * _SUFFIX[unit])
        except ValueError:
            raise ValueError(f"memory limit {text!r}: expected bytes, optionally with a K/M/G/T suffix") from None
    if value < 0:
        raise ValueError(f"memory limit {text!r}: must not be negative")
    return value


def _limit_for(device, memory_limit: Limit) -> Optional[int]:
    if memory_limit is None:
        memory_limit = _GRANTED.get()
    if memory_limit is None:
        env = os.environ.get(ENV_LIMIT)
        return None if not env else parse_bytes(env)
    if isinstance(memory_limit, Mapping):
        value = memory_limit.get(device)
        return None if value is None else parse_bytes(value)
    return parse_bytes(memory_limit)


def limit_note(devices, memory_limit: Limit = None) -> str:
    """Where the limit on ``devices`` comes from, for messages: ``""`` when none bounds them but their own
    memory."""
    limits = {d: _limit_for(d, memory_limit) for d in devices}
    if all(v is None for v in limits.values()):
        return ""
    if memory_limit is not None:
        source = "the memory_limit argument"
    elif _GRANTED.get() is not None:
        source = "the room granted to this solve by its caller (e.g. the part of a device budget torch does not hold)"
    else:
        source = f"the environment variable {ENV_LIMIT}"
    most = max(v for v in limits.values() if v is not None)
    return f"; the limit ({most} bytes at most a device) is {source}"


def live_bytes(devices) -> dict:
    """Bytes of live JAX arrays held on each of ``devices`` (the CPU stand-in for ``bytes_in_use``)."""
    wanted = set(devices)
    used = collections.Counter()
    for arr in jax.live_arrays():
        try:
            if arr.is_deleted():
                continue
            placement = arr.sharding.devices_indices_map(arr.shape)
        except Exception:  # pragma: no cover - deleted while iterating
            continue
        for dev, index in placement.items():
            if dev in wanted:
                shape = [len(range(*sl.indices(n))) for sl, n in zip(index, arr.shape)]
                used[dev] += math.prod(shape) * arr.dtype.itemsize
    return {d: used[d] for d in devices}


def free_bytes(devices, memory_limit: Limit = None, reserve=0) -> dict:
    """Free bytes of each addressable device in ``devices`` (:data:`UNLIMITED` when nothing bounds it).

    Args:
      devices: addressable jax devices.
      memory_limit: simulated per-device limit (bytes, ``"2G"``, or a mapping device -> limit); default: the
        environment variable ``JGPTQ_DEVICE_MEMORY_LIMIT``, else none.
      reserve: bytes kept free on every device (an int), or a mapping device -> bytes (e.g. what torch holds on
        a GPU it shares with JAX, which JAX's statistics do not see).
    Returns:
      dict device -> int bytes, never negative.
    """
    stats = {d: d.memory_stats() for d in devices}
    limits = {d: _limit_for(d, memory_limit) for d in devices}
    need_live = [d for d in devices if stats[d] is None and limits[d] is not None]
    live = live_bytes(need_live) if need_live else {}
    out = {}
    for d in devices:
        st, limit = stats[d], limits[d]
        if st is not None and "bytes_limit" in st:
            real = int(st["bytes_limit"]) - int(st.get("bytes_in_use", 0))
            free = real if limit is None else min(real, limit - int(st.get("bytes_in_use", 0)))
        elif limit is not None:
            free = limit - live.get(d, 0)
        else:
            free = UNLIMITED
        r = reserve.get(d, 0) if isinstance(reserve, Mapping) else reserve
        out[d] = max(0, free - int(r)) if free < UNLIMITED else free
    return out


def program_peak(compiled) -> int:
    """Per-device peak bytes of a compiled program, from ``compiled.memory_analysis()`` (no allocation).

    Uses ``peak_memory_in_bytes`` where the backend reports it (and it is not below the sum), else
    ``argument + output - alias + temp`` bytes.
    """
    ma = compiled.memory_analysis()
    if ma is None:  # pragma: no cover - backends without analysis
        raise RuntimeError("this backend gives no memory analysis of compiled programs; pass memory_limit")
    if isinstance(ma, (list, tuple)):  # pragma: no cover - older per-device lists
        ma = ma[0]
    total = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
             + ma.temp_size_in_bytes)
    peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    return max(peak, int(total))
