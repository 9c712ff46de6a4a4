"""argparse types for a command's own flags (``--preflight-timeout``, ``--gpus-per-node``...).

A bad value is refused while the command line is parsed, as a launch setting is (exit code 2,
the flag and the value, a HINT), not with argparse's bare "invalid int value", and nan, inf and
negative numbers never reach the code. Each type's ``kind`` (one of
:data:`phalanx.settings.options.VALUE_KINDS`, or its own) lets the bad-input matrix try the bad
values of its kind on every flag of every command.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from phalanx.errors import SettingsRefused
from phalanx.settings import values

T = TypeVar("T")


def parsed(parse: Callable[[Any], T], value: Any) -> T:
    """``parse(value)``, an :class:`values.InvalidValue` refused as a bad flag is (with its HINT).

    Example:
        >>> parsed(values.parse_nnodes, "2:4")
        NodeRange(min=2, max=4)
    """
    try:
        return parse(value)
    except values.InvalidValue as invalid:
        raise SettingsRefused(invalid.why, hint=invalid.hint) from None


class Argument:
    """An argparse ``type``: ``parse`` turns ``flag``'s text into a value, or raises
    :class:`values.InvalidValue` or :class:`SettingsRefused`; ``kind`` is the class of value
    ("count", "seconds", "name"...).

    Example:
        >>> Argument("--grace", "seconds", lambda text: values.parse_seconds(text, name="--grace"))("30")
        30.0
    """

    def __init__(self, flag: str, kind: str, parse: Callable[[str], Any]) -> None:
        self.flag = flag
        self.kind = kind
        self.parse = parse
        self.__name__ = kind  # argparse names the type in its own messages

    def __call__(self, text: str) -> Any:
        return parsed(self.parse, text)

    def __repr__(self) -> str:
        return f"Argument({self.flag!r}, {self.kind!r})"


def count(flag: str, *, minimum: int = 1, example: int) -> Argument:
    """A whole number of at least ``minimum``: ``--gpus-per-node``, ``--max-requeues``.

    Example:
        >>> count("--max-requeues", minimum=0, example=3)("3")
        3
    """

    def parse(text: str) -> int:
        try:
            return values.parse_int(text, minimum=minimum, name=flag)
        except values.InvalidValue as invalid:
            raise values.InvalidValue(invalid.why, f"for example {flag} {example}") from None

    return Argument(flag, "count", parse)


def seconds(flag: str, example: int) -> Argument:
    """A positive, finite number of seconds: ``--preflight-timeout``, ``--grace``.

    Example:
        >>> seconds("--preflight-timeout", example=30)("2.5")
        2.5
    """
    return Argument(flag, "seconds", lambda text: values.parse_seconds(text, name=flag, example=example))
