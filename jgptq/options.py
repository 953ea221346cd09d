"""Command-line options declared on the configuration's fields.

A field of :mod:`jgptq.config` that the ``jgptq`` command exposes says so in its metadata, made by :func:`flag`:
the flag, its help, choices, type, metavar, the command line's default when it is not the field's, and how the
parsed value becomes the field's value. The command's parser adds the option with :func:`add_options`, its
configuration takes the values with :func:`config_values`, and :mod:`jgptq.surface` names the flag in messages:
one declaration, three uses. Pure Python (parsing imports neither torch nor JAX).

    >>> import argparse
    >>> from jgptq.config import MoEConfig
    >>> parser = argparse.ArgumentParser()
    >>> add_options(parser, "moe.calibration", "moe.min_tokens", "moe.router_weighting")
    >>> config_values(parser.parse_args(["--min-tokens", "16"]), MoEConfig)
    {'calibration': 'routed', 'min_tokens': 16, 'router_weighting': 'none'}
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["CommandError", "Flag", "add_options", "comma_list", "config_values", "declared", "flag", "flag_of",
           "format_rules", "listed", "negated"]

FIELD_DEFAULT = object()   # Flag.default: the command line's default is the field's


class CommandError(ValueError):
    """Bad input to a command (the message says what and how to fix it)."""


def _same(value):
    return value


def listed(values) -> tuple:
    """A repeatable option (None when never given) as a tuple."""
    return tuple(values or ())


def negated(value: bool) -> bool:
    """A switch that turns the field off (``--quiet`` for ``progress``)."""
    return not value


def comma_list(text: str | None) -> tuple:
    """``"q2_k, q4_k"`` as ``("q2_k", "q4_k")`` (None or empty: ``()``)."""
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def format_rules(texts) -> tuple:
    """``--tensor-format REGEX=FORMAT`` options as ``((regex, format), ...)``; the last ``=`` splits."""
    rules = []
    for text in texts or ():
        pattern, sep, name = text.rpartition("=")
        if not sep or not pattern or not name:
            raise CommandError(f"--tensor-format {text!r}: expected REGEX=FORMAT, e.g. 'v_proj$=q6_k'")
        rules.append((pattern, name))
    return tuple(rules)


@dataclasses.dataclass(frozen=True)
class Flag:
    """The command-line option of one configuration field.

    Attributes:
      name: the flag (``"--group-size"``); the parsed namespace holds it under :attr:`dest`.
      help: what the option does; ``{default}`` stands for the command line's default.
      type, metavar, nargs, const, action: as :meth:`argparse.ArgumentParser.add_argument` takes them.
      choices: the values allowed, or a function giving them when the parser is built (lists kept elsewhere).
      default: the command line's default (:data:`FIELD_DEFAULT`: the field's own).
      to_config: the parsed value -> the field's value.
      off, off_help: a boolean field's second flag, which sets it False (``--asym`` beside ``--sym``); the help of
        whichever flag gives the default says so.
    """

    name: str
    help: str
    type: Callable | None = None
    choices: Any = None
    metavar: str | None = None
    nargs: str | None = None
    const: Any = None
    action: str | None = None
    default: Any = FIELD_DEFAULT
    to_config: Callable = _same
    off: str | None = None
    off_help: str = ""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def flag(name: str, help: str, **options) -> dict:
    """Field metadata declaring the field's command-line option (:class:`Flag` takes ``options``)."""
    return {"flag": Flag(name, help, **options)}


def _field(config_class, path: str) -> dataclasses.Field:
    """The field of a dotted path (``"quant.bits"``) from ``config_class`` (nested configs: their defaults' class)."""
    *parents, name = path.split(".")
    for parent in parents:
        config_class = type({f.name: f for f in dataclasses.fields(config_class)}[parent].default)
    return {f.name: f for f in dataclasses.fields(config_class)}[name]


def _cli_default(field: dataclasses.Field, option: Flag):
    return field.default if option.default is FIELD_DEFAULT else option.default


def add_options(parser, *paths: str, config_class=None) -> None:
    """Adds the options of the fields ``paths`` (dotted from :class:`jgptq.config.PipelineConfig`, or from
    ``config_class``) to ``parser`` (a parser or an argument group), in that order."""
    if config_class is None:
        from jgptq.config import PipelineConfig as config_class
    for path in paths:
        field = _field(config_class, path)
        option = field.metadata.get("flag")
        if option is None:
            raise KeyError(f"{path} declares no command-line option")
        default = _cli_default(field, option)
        if option.off is not None:
            pair = parser.add_mutually_exclusive_group()
            pair.add_argument(option.name, dest=option.dest, action="store_true", default=default,
                              help=option.help + (" (default)" if default else ""))
            pair.add_argument(option.off, dest=option.dest, action="store_false",
                              help=option.off_help + ("" if default else " (default)"))
            continue
        choices = option.choices() if callable(option.choices) else option.choices
        given = {"type": option.type, "choices": choices, "metavar": option.metavar, "nargs": option.nargs,
                 "const": option.const, "action": option.action}
        parser.add_argument(option.name, dest=option.dest, default=default,
                            help=option.help.format(default=default),
                            **{key: value for key, value in given.items() if value is not None})


def config_values(args: argparse.Namespace, config_class) -> dict:
    """Field name -> value of every field of ``config_class`` (not those of nested configs) that declares an
    option, from the parsed ``args``."""
    return {f.name: f.metadata["flag"].to_config(getattr(args, f.metadata["flag"].dest))
            for f in dataclasses.fields(config_class) if "flag" in f.metadata}


def flag_of(name: str) -> Flag | None:
    """The option of the field ``name`` of :class:`jgptq.config.PipelineConfig`, :class:`QuantConfig` or
    :class:`MoEConfig`, or None when it has none."""
    from jgptq.config import MoEConfig, PipelineConfig, QuantConfig

    for config_class in (PipelineConfig, QuantConfig, MoEConfig):
        for f in dataclasses.fields(config_class):
            if f.name == name and "flag" in f.metadata:
                return f.metadata["flag"]
    return None


def declared(config_class=None, prefix: str = "") -> list:
    """The dotted paths of every field under ``config_class`` (default :class:`jgptq.config.PipelineConfig`)
    that declares an option."""
    if config_class is None:
        from jgptq.config import PipelineConfig as config_class
    paths = []
    for f in dataclasses.fields(config_class):
        if "flag" in f.metadata:
            paths.append(prefix + f.name)
        elif dataclasses.is_dataclass(f.default):
            paths += declared(type(f.default), f"{prefix}{f.name}.")
    return paths
