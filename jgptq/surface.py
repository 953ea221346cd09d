"""How a message names an option: as the Python argument (``block_fallback='llama.cpp'``) or, when the ``jgptq``
command runs, as its command-line flag (``--block-fallback llama.cpp``).

A message that tells the user how to go on names the option they can actually type. The library speaks Python by
default; the command line runs its commands inside :func:`command_line`, and every message built with
:func:`option` inside it names flags instead. Pure Python, no torch.

    >>> option("overwrite")
    'overwrite=True'
    >>> with command_line():
    ...     option("block_fallback", "llama.cpp")
    '--block-fallback llama.cpp'
"""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["command_line", "on_command_line", "option"]

_ON_COMMAND_LINE = contextvars.ContextVar("jgptq_on_command_line", default=False)

# name -> (Python spelling, command-line spelling) of options named without a value; a command-line spelling of
# None is the field's flag and metavar (:func:`jgptq.options.flag_of`: ``--exclude REGEX``)
_FIXED = {
    "overwrite": ("overwrite=True", "--overwrite"),
    "formats": ("formats=[(regex, format)]", None),
    "exclude": ("exclude=[...]", None),
    "no_resume": ("resume=False", "--no-resume"),
    "target_formats": ("target_formats=[...]", None),
    "block_fallback": ("block_fallback='llama.cpp' or a format name",
                       "--block-fallback llama.cpp (or a format name)"),
}

# Python argument -> its flag, for options that are no configuration field (a field's flag is declared on it)
_FLAGS = {"device": "--device"}


def _flag(name: str, metavar: bool = False) -> str:
    """The flag of the Python argument ``name`` (with its metavar: ``--exclude REGEX``); KeyError if none."""
    from jgptq.options import flag_of

    declared = flag_of(name)
    if declared is None:
        return _FLAGS[name]
    return f"{declared.name} {declared.metavar}" if metavar else declared.name


def on_command_line() -> bool:
    """Whether the current code runs under the ``jgptq`` command (inside :func:`command_line`)."""
    return _ON_COMMAND_LINE.get()


@contextlib.contextmanager
def command_line():
    """Messages built inside name command-line flags (the ``jgptq`` command runs its work in here)."""
    token = _ON_COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _ON_COMMAND_LINE.reset(token)


_NO_VALUE = object()


def option(name: str, value=_NO_VALUE) -> str:
    """The option ``name`` (a Python argument name) as the user can type it where the code runs.

    Without ``value``: the option's usual spelling (``overwrite=True`` / ``--overwrite``). With ``value``:
    ``name=value`` in Python (``repr`` of strings, ``%g`` of floats) or ``--flag value`` on the command line.
    Raises KeyError for a name this module does not know (a message would otherwise name a flag that is not there).
    """
    cli = on_command_line()
    if value is _NO_VALUE:
        python, command = _FIXED[name]
        if not cli:
            return python
        return command or _flag(name, metavar=True)
    if cli:
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return f"{_flag(name)} {shown}"
    shown = f"{value:g}" if isinstance(value, float) else repr(value)
    return f"{name}={shown}"
