"""Traced programs kept on disk between runs, so that a run with a warm compile cache skips Python tracing too.

JAX's persistent compilation cache (:func:`jgptq.xla_options.enable_compilation_cache`) keeps compiled
executables, but it finds them by the lowered module: every run still traces and lowers each program first. For a
GGML solve that is most of the first layer's time (thousands of equations traced through ``vmap``, on the H200
about 3 s a bucket). This store keeps each engine program as a serialized :func:`jax.export.export` (StableHLO,
no pickle) under a key that names everything the trace depends on; a later run deserializes it and lowers only a
call of it, whose compiled executable the persistent cache then supplies.

Both the first and every later run compile the same thing, a jit of the exported call, so a program's results
do not depend on whether it came from the store.

Key: the program function's type and ``repr`` (only functions of the ``jgptq`` package whose ``repr`` holds no
object address: frozen dataclasses of a config, such as the solver's), the avals and axes of its arguments, the
mesh (device count, platform, device kind), experts per device and vmap width, the compiler options, the versions
of JAX, jaxlib and every source file of the ``jgptq`` package, the ``JGPTQ_`` environment variables and JAX's
configuration. Anything else is traced as before. The store is the ``programs`` folder of the compile cache folder
and follows its opt-out (``JGPTQ_COMPILATION_CACHE=0``); a file that does not load is traced again and replaced.
Beyond :data:`MAX_BYTES` the entries used least recently are removed.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Optional

import jax

from jgptq import xla_options
from jgptq.gptq import GPTQResult

log = logging.getLogger("jgptq.parallel")

# Result types of the engine's programs, named in serialized exports (other pytree nodes than lists, tuples, dicts
# and these make a program that is traced every run).
jax.export.register_namedtuple_serialization(GPTQResult, serialized_name="jgptq.gptq.GPTQResult")

FOLDER = "programs"
# Most bytes the store keeps: each change of jgptq's sources or of JAX starts new entries, so the ones used least
# recently are removed beyond this (a 48-layer GGML run of a 30B MoE model keeps about 2 MB).
MAX_BYTES = 256 << 20
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def folder() -> Optional[Path]:
    """The store's folder (inside :func:`jgptq.xla_options.compilation_cache_dir`), or None when caching is off."""
    base = xla_options.compilation_cache_dir()
    return None if base is None else Path(base) / FOLDER


@functools.lru_cache(maxsize=4)
def source_digest(root: Optional[Path] = None) -> str:
    """sha256 of every ``.py`` file under ``root`` (default: the ``jgptq`` package), relative paths and bytes;
    computed once per root."""
    root = Path(__file__).resolve().parent.parent if root is None else Path(root)
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> str:
    import jaxlib

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("JGPTQ_") or k == "XLA_FLAGS")
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k and "log" not in k)
    return repr((jax.__version__, jaxlib.__version__, source_digest(), env, config))


def stable_name(fn) -> Optional[str]:
    """A text naming ``fn``'s behaviour across processes, or None when there is none: only callables of the
    ``jgptq`` package whose ``repr`` holds no object address."""
    module = getattr(type(fn), "__module__", "") or ""
    if not (module == "jgptq" or module.startswith("jgptq.")):
        return None
    text = repr(fn)
    if _ADDRESS.search(text):
        return None
    return f"{module}.{type(fn).__qualname__}:{text}"


def key(fn, parts) -> Optional[str]:
    """The store's key (hex sha256) of program ``fn`` under ``parts`` (a repr-stable description of everything
    else the program depends on), or None when ``fn`` has no :func:`stable_name`."""
    name = stable_name(fn)
    if name is None:
        return None
    return hashlib.sha256(repr((name, parts, _environment())).encode()).hexdigest()


def lower(program, structs, fn, parts, *, out_shardings=None):
    """``program.lower(*structs)`` through the store: the lowered call of the stored export of ``program``
    (exported now and stored when missing), or ``program.lower(*structs)`` itself where no key exists, the
    store is off, or exporting fails.

    Args:
      program: a ``jax.jit`` function.
      structs: its arguments as ``jax.ShapeDtypeStruct`` (with shardings) or None.
      fn, parts: what :func:`key` is made of.
      out_shardings: passed to the ``jax.jit`` of the exported call (the program's own output shardings).
    """
    place = folder()
    name = None if place is None else key(fn, parts)
    if name is None:
        return program.lower(*structs)
    path = place / f"{name}.jaxexport"
    exported = _load(path)
    if exported is None:
        try:
            exported = jax.export.export(
                program, disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("ALL")])(*structs)
            _store(path, exported.serialize())
        except Exception as exc:  # a program export cannot hold: traced every run, as without the store
            log.debug("program store: %s not exported (%s: %s)", stable_name(fn), type(exc).__name__, exc)
            return program.lower(*structs)
    return jax.jit(exported.call, out_shardings=out_shardings).lower(*structs)


def _load(path: Path):
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        exported = jax.export.deserialize(bytearray(data))
    except Exception as exc:
        log.warning("program store: %s does not load (%s: %s); tracing again", path, type(exc).__name__, exc)
        try:
            path.unlink()
        except OSError:
            pass
        return None
    try:
        os.utime(path)      # used now: the last to be removed when the store is over MAX_BYTES
    except OSError:
        pass
    return exported


def _store(path: Path, data) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(data))
        os.replace(tmp, path)
    except OSError as exc:  # an unwritable folder only costs tracing time
        log.debug("program store: %s not written (%s)", path, exc)
        return
    prune(path.parent, keep=path)


def prune(place: Path, limit: Optional[int] = None, keep: Optional[Path] = None) -> None:
    """Removes the least recently used entries of the store folder ``place`` until it holds at most ``limit``
    bytes (default :data:`MAX_BYTES`), never ``keep``."""
    limit = MAX_BYTES if limit is None else limit
    entries = []
    for p in place.glob("*.jaxexport"):
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        if p == keep:
            continue
        try:
            p.unlink()
            total -= size
        except OSError:
            pass
