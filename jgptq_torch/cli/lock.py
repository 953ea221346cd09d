"""One ``jgptq quantize`` run per output: a lock file beside ``--out``, and the leftovers of a killed run removed
under it.

Two runs with the same ``--out`` would share one working folder (``<OUT>.jgptq-work``) and both do all the work.
:func:`output_lock` creates ``<OUT>.jgptq-lock`` (holding the process id, host and start time) with an exclusive
create; a second run finds it and refuses at once, naming the lock and the running process. A lock left by a process
that is gone (killed with ``kill -9``, a machine restarted) is taken over. The lock goes when the run ends, however
it ends.

:func:`remove_leftovers`: the hidden temporary files a killed export leaves beside the output (``.NAME.gguf.XXXX.tmp``
of a GGUF file being written, ``.NAME.header.XXXX``, ``.NAME.partial-XXXX`` folders of a checkpoint): only a run
holding the lock removes them, since no other run can be writing them then.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path

from jgptq_torch.cli.command_inputs import CommandError, log


def lock_path(out) -> Path:
    """The lock file of output ``out``: ``<OUT>.jgptq-lock`` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".jgptq-lock")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: it exists
        return True
    return True


def _holder(path: Path):
    """The lock's record, or None when it is unreadable (a lock being written, or garbage)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _stale(record) -> bool:
    """Whether the process that wrote ``record`` is gone (only decidable on the same host)."""
    return (isinstance(record, dict) and record.get("host") == socket.gethostname()
            and isinstance(record.get("pid"), int) and not _alive(record["pid"]))


def _unwritable(out, path: Path, exc: OSError):
    raise CommandError(f"--out {str(out)!r}: cannot write in {str(path.parent)!r} ({exc.strerror or exc}); choose an "
                       f"--out in a writable folder") from None


@contextlib.contextmanager
def output_lock(out, quiet: bool = False):
    """Holds ``<OUT>.jgptq-lock`` for the body; refuses (:class:`CommandError`) when a live run holds it, and takes
    over the lock of a process that is gone (saying so). Creates the parent folder of ``out`` if missing."""
    path = lock_path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)   # the output's folder: the export would need it anyway
    except OSError as exc:
        _unwritable(out, path, exc)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = _holder(path)
            if not _stale(held):
                who = (f"process {held['pid']} on {held['host']}, started {held['started']}"
                       if isinstance(held, dict) and {"pid", "host", "started"} <= held.keys() else "another process")
                raise CommandError(f"another jgptq run is writing {str(out)!r}: {who} holds the lock {path}; wait "
                                   f"for it to finish, or choose another --out (if no such run exists, remove the "
                                   f"lock file)") from None
            log(f"taking over the lock {path} of process {held['pid']}, which is gone", quiet)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        except OSError as exc:   # a read-only folder or file system: said now, not after the model has loaded
            _unwritable(out, path, exc)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        break
    else:
        raise CommandError(f"could not take the lock {path}: other runs keep taking it; try again")
    try:
        yield path
    finally:
        if _holder(path) == record:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def remove_leftovers(outputs, quiet: bool = False) -> int:
    """Removes the temporary files and folders a killed export left beside each path of ``outputs`` (the output
    and, for a GGUF run into a folder, the file in it; module docstring); returns the bytes freed (said on stderr
    unless ``quiet``). Call only while holding :func:`output_lock`."""
    freed, names = 0, []
    for out in map(Path, outputs):
        if not out.parent.is_dir():
            continue
        for p in out.parent.glob(f".{out.name}.*"):
            rest = p.name[len(out.name) + 2:]
            if not (rest.endswith(".tmp") or rest.startswith(("header.", "partial-"))):
                continue
            if p.is_dir():
                freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
                shutil.rmtree(p, ignore_errors=True)
            else:
                freed += p.stat().st_size
                p.unlink(missing_ok=True)
            names.append(str(p))
    if names:
        log(f"removed what a killed run left: {', '.join(sorted(names))} ({freed:,} bytes)", quiet)
    return freed
