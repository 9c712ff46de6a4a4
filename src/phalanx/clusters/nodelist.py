"""SLURM's host list grammar, expanded by phalanx itself (containers often have no ``scontrol``).

A host list is a comma-separated list of host patterns; a pattern is a name with any number of
bracketed groups, each a comma-separated list of numbers and ``LOW-HIGH`` ranges. The width of
``LOW`` is kept (``gpu[07-10]`` is gpu07, gpu08, gpu09, gpu10), and several groups expand as
their product, the first varying slowest (``r[1-2]n[1-2]`` is r1n1, r1n2, r2n1, r2n2), as
``scontrol show hostnames`` does.
"""

from __future__ import annotations

import itertools
import re

#: Expanding a typo such as ``n[1-999999]`` would take the launcher's memory; no allocation is that big.
MAX_HOSTS = 100_000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class NodelistError(ValueError):
    """A host list that does not parse; the message says where and why."""


def expand_nodelist(text: str) -> list[str]:
    """The host names of a SLURM host list, in order; :class:`NodelistError` where it does not parse
    (an unclosed bracket, a range that runs backwards, a group with no numbers) or names more than
    :data:`MAX_HOSTS` hosts.

    Example:
        >>> expand_nodelist("n[1-2],login")
        ['n1', 'n2', 'login']
    """
    hosts: list[str] = []
    for pattern in _split_patterns(text):
        hosts += _expand_pattern(pattern)
        if len(hosts) > MAX_HOSTS:
            raise NodelistError(f"it names more than {MAX_HOSTS} hosts")
    if not hosts:
        raise NodelistError("it names no host")
    return hosts


def _split_patterns(text: str) -> list[str]:
    """Splits at the commas outside brackets."""
    patterns, current, depth = [], "", 0
    for char in text.strip():
        if char == "[":
            if depth:
                raise NodelistError(f"a '[' inside brackets in {text!r}")
            depth = 1
        elif char == "]":
            if not depth:
                raise NodelistError(f"a ']' without its '[' in {text!r}")
            depth = 0
        if char == "," and not depth:
            patterns.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise NodelistError(f"a '[' is never closed in {text!r}")
    patterns.append(current)
    for pattern in patterns:
        if not pattern.strip():
            raise NodelistError(f"an empty host name in {text!r}")
        if any(char.isspace() for char in pattern):
            raise NodelistError(f"a host name with a space in {text!r}")
    return patterns


def _expand_pattern(pattern: str) -> list[str]:
    # "gpu-[01-03]x[1,2]" -> literal parts ["gpu-", "x", ""] and groups ["01-03", "1,2"]
    parts = re.split(r"\[([^\]]*)\]", pattern)
    literals, groups = parts[0::2], parts[1::2]
    choices = [_expand_group(group, pattern) for group in groups]
    hosts = []
    for numbers in itertools.product(*choices):
        hosts.append("".join(literal + number for literal, number in zip(literals, (*numbers, ""))))
    return hosts


def _expand_group(group: str, pattern: str) -> list[str]:
    numbers: list[str] = []
    for item in group.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise NodelistError(f"[{group}] in {pattern!r}: {item!r} is neither a number nor a LOW-HIGH range")
        low_text, high_text = match.group(1), match.group(2)
        if high_text is None:
            numbers.append(low_text)
            continue
        low, high = int(low_text), int(high_text)
        if high < low:
            raise NodelistError(f"[{group}] in {pattern!r}: the range {item} runs backwards")
        if high - low >= MAX_HOSTS:
            raise NodelistError(f"[{group}] in {pattern!r}: the range {item} names more than {MAX_HOSTS} hosts")
        width = len(low_text)
        numbers += [str(number).zfill(width) for number in range(low, high + 1)]
    return numbers
