"""argparse types for a command's own flags (``--preflight-timeout``, ``--gpus-per-node``...).

A bad value is refused while the command line is parsed, as a launch setting is: exit code 2, a
message that names the flag and the value, a HINT, and nothing started. Plain ``type=int`` or
``type=float`` would let argparse answer with its bare "invalid int value", and let nan, inf and
negative numbers through to the code that uses them.

Each type carries its ``kind`` (one of :data:`phalanx.settings.options.VALUE_KINDS`, or a kind of
its own), so that the bad-input matrix finds every flag of every command and tries the bad values
of its kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.errors import SettingsRefused
from phalanx.settings import values


class Argument:
    """An argparse ``type``: parses a flag's text, or refuses it with the flag's name and a HINT.

    Args:
        flag: the flag as the user writes it, such as ``--preflight-timeout``.
        kind: the class of value it takes ("count", "seconds", "name"...).
        parse: text to value; raises :class:`values.InvalidValue` or :class:`SettingsRefused`.

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
        try:
            return self.parse(text)
        except values.InvalidValue as invalid:
            raise SettingsRefused(invalid.why, hint=invalid.hint) from None

    def __repr__(self) -> str:
        return f"Argument({self.flag!r}, {self.kind!r})"


def count(flag: str, minimum: int = 1, example: int | None = None) -> Argument:
    """A whole number of at least ``minimum``: ``--gpus-per-node``, ``--max-requeues``.

    Example:
        >>> count("--max-requeues", minimum=0, example=3)("3")
        3
    """

    def parse(text: str) -> int:
        try:
            return values.parse_int(text, minimum=minimum, name=flag)
        except values.InvalidValue as invalid:
            raise values.InvalidValue(
                invalid.why, f"for example {flag} {example}" if example else invalid.hint
            ) from None

    return Argument(flag, "count", parse)


def seconds(flag: str, example: int) -> Argument:
    """A positive, finite number of seconds: ``--preflight-timeout``, ``--grace``.

    Example:
        >>> seconds("--preflight-timeout", example=30)("2.5")
        2.5
    """
    return Argument(flag, "seconds", lambda text: values.parse_seconds(text, name=flag, example=example))
