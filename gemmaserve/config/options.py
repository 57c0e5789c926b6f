"""Declaring options once: a dataclass field carries its CLI flag, help and parser.

Every command-line entry point builds its parser from the same dataclasses (`EngineConfig`,
`SamplingParams`), so adding an option is adding a field.

    @dataclass
    class Example:
        page_size: int = option(16, help="tokens per KV page", parse=positive_int)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import UserInputError
from ..units import format_bytes, parse_size  # noqa: F401 - re-exported for the option parsers

_META = "gemmaserve.option"


@dataclasses.dataclass(frozen=True)
class OptionMeta:
    help: str
    parse: Callable[[str], Any] | None
    choices: Sequence[str] | None
    flag: str | None
    negatable: bool
    multiple: bool
    nargs: bool


def option(default: Any, *, help: str, parse: Callable[[str], Any] | None = None,
           choices: Sequence[str] | None = None, flag: str | None = None, negatable: bool = False,
           multiple: bool = False, nargs: bool = False) -> Any:
    """A dataclass field that is also a command-line option. bool fields (and `negatable` ones, whose
    default None means "auto") get --x/--no-x; `multiple` ones collect repeated flags into a list, `nargs`
    ones also several values after one flag (for options that never precede a positional argument)."""
    meta = OptionMeta(help, parse, choices, flag, negatable or isinstance(default, bool), multiple or nargs, nargs)
    return dataclasses.field(default=default, metadata={_META: meta})


def add_options(parser: argparse.ArgumentParser, cls: type, title: str, only: Sequence[str] | None = None) -> None:
    """`only`: these fields' options alone."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        meta: OptionMeta | None = f.metadata.get(_META)
        if meta is None or (only is not None and f.name not in only):
            continue
        flag = meta.flag or "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        default_text = "" if f.default in (None, dataclasses.MISSING) else f" (default: {f.default})"
        if meta.negatable:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=meta.help + default_text, **kwargs)
            continue
        if meta.parse is not None:
            kwargs["type"] = meta.parse
        if meta.nargs:
            kwargs["action"], kwargs["nargs"] = "extend", "+"
        elif meta.multiple:
            kwargs["action"] = "append"
        if meta.choices is not None:
            kwargs["choices"] = list(meta.choices)
        group.add_argument(flag, help=meta.help + default_text, **kwargs)


def from_namespace(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """Build `cls` from the options present in `ns` (absent ones keep their dataclass default)."""
    names = {f.name for f in dataclasses.fields(cls) if _META in f.metadata}
    values = {n: getattr(ns, n) for n in names if hasattr(ns, n)}
    values.update(overrides)
    return cls(**values)


# -- parsers: raise UserInputError, which argparse shows as "argument --x: <message>" -----------
def argparse_type(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    def wrapped(text: str) -> Any:
        try:
            return fn(text)
        except UserInputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    wrapped.__name__ = fn.__name__
    return wrapped


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserInputError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserInputError(f"expected a number, got {text!r}") from None


positive_int = argparse_type(lambda t: _checked(_int(t), lambda v: v >= 1, "must be >= 1"))
any_int = argparse_type(_int)
number = argparse_type(_float)
port_number = argparse_type(lambda t: _checked(_int(t), lambda v: 0 <= v <= 65535, "must be a port in [0, 65535]"))


def _checked(value: Any, ok: Callable[[Any], bool], why: str) -> Any:
    if not ok(value):
        raise UserInputError(f"{why}, got {value}")
    return value


size = argparse_type(parse_size)


def refusing(reasons: dict[str, str]) -> Callable[[str], str]:
    """The parser of a `choices` option that says why some values, deliberately not offered, are
    refused (argparse alone would answer a bare "invalid choice")."""
    def check(text: str) -> str:
        if text in reasons:
            raise UserInputError(reasons[text])
        return text
    return argparse_type(check)
