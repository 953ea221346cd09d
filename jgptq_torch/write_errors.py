"""Files that could not be written (a full disk, a read-only folder, ...), as one error that names the file.

Writers differ in what they raise on a failed write: Python's ``open``/``write`` an :class:`OSError` (often without
the file's name), safetensors a ``SafetensorError`` whose text ends in ``(os error N)``. :func:`writing` wraps a
write of one path and turns either into a :class:`WriteError` (an :class:`OSError` with the path and the
operating system's errno); :func:`failure_message` is what the command line says then.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path

_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class WriteError(OSError):
    """A file could not be written: ``filename`` (the path), ``errno`` and ``strerror`` (the reason)."""

    def __str__(self) -> str:
        return f"could not write {self.filename}: {self.strerror}"


def os_error(exc: BaseException) -> "OSError | None":
    """The operating-system error behind ``exc``: itself when it is an OSError, one built from the ``(os error N)``
    of a safetensors error, else None."""
    if isinstance(exc, OSError):
        return exc
    if type(exc).__name__ == "SafetensorError":
        found = _OS_ERROR.search(str(exc))
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
    return None


@contextlib.contextmanager
def writing(path):
    """Turns an OS-level failure of the writes inside into a :class:`WriteError` naming ``path``."""
    try:
        yield
    except WriteError:
        raise
    except Exception as exc:  # noqa: BLE001 - only OS-level failures are converted, the rest re-raised
        cause = os_error(exc)
        if cause is None or cause.errno is None:
            raise
        raise WriteError(cause.errno, cause.strerror or os.strerror(cause.errno), str(path)) from exc


def failure_message(exc: WriteError, work_dir, written=None) -> str:
    """The command line's one-line account of a failed write: the path and why, what the work folder keeps
    (read from its ``state.json``) and that running the same command again continues after the fix (with
    ``--overwrite`` when the checkpoint ``written`` is already complete)."""
    work = Path(work_dir)
    done = total = None
    try:
        state = json.loads((work / "state.json").read_text())
        done, total = int(state["layers_done"]), state.get("fingerprint", {}).get("layers")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    full = exc.errno == errno.ENOSPC
    what = (f"no space left on device while writing {exc.filename}" if full
            else f"could not write {exc.filename} ({exc.strerror})")
    fix = "free space" if full else "fix that"
    if not done:
        return f"{what}; no layer had finished, so there is no work state to keep: {fix} and run the same command again"
    if written is not None:
        return (f"{what}; the checkpoint {written} is complete and the work state of all {done} layers is kept in "
                f"{work}: {fix} and run the same command again with --overwrite to write it without quantizing again")
    if isinstance(total, int) and done >= total:
        then = "to export without quantizing again"
        kept = f"the work state of all {done} layers"
    else:
        then = f"to continue after layer {done - 1}"
        kept = f"the work state up to the last finished layer ({done} layer{'s' if done > 1 else ''} done)"
    return f"{what}; {kept} is kept in {work}: {fix} and run the same command again {then}"
