"""The hosts of a ``phalanx launch``: from ``--hosts h1,h2:4`` or a hostfile (``host slots=N``, the
format DeepSpeed, Horovod and OpenMPI read), checked before anything connects."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import SettingsRefused

#: A host as ssh takes it: a name from ssh's config, a DNS name or an address, with ``user@``.
_HOST = re.compile(r"^(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class SshHost:
    """One host: its name as ssh takes it, and how many worker processes it runs (None: as
    ``--nproc-per-node`` says)."""

    name: str
    slots: int | None = None

    @property
    def label(self) -> str:
        """The name without ``user@``: the prefix of the host's output lines."""
        return self.name.rpartition("@")[2]


def parse_host_list(text: str) -> list[SshHost]:
    """``--hosts h1,h2:4,user@h3`` as hosts, in order (the first hosts the rendezvous); ``:N`` is
    the host's slots.

    Example:
        >>> parse_host_list("gpu1:4,gpu2:4")
        [SshHost(name='gpu1', slots=4), SshHost(name='gpu2', slots=4)]
    """
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if item.count(":") > 1 or item.startswith("["):
            raise SettingsRefused(f"--hosts {text}: {item!r} looks like an IPv6 address",
                                  "phalanx launch reaches hosts by name or IPv4 address; ':' introduces the slots.",
                                  "name the host in ~/.ssh/config (Host gpu1 / HostName fe80::1) and give that name")  # fmt: skip
        name, colon, slots = item.partition(":")
        if not item or not _HOST.match(name):
            raise SettingsRefused(
                f"--hosts {text}: {item!r} is not a host",
                "each host is a name or an address, optionally user@ before it and :SLOTS after it.",
                "for example --hosts gpu1,gpu2 or --hosts gpu1:4,gpu2:4",
            )
        hosts.append(SshHost(name, _slots(slots, f"--hosts {text}") if colon else None))
    return _checked(hosts, f"--hosts {text}")


def read_hostfile(path: Path) -> list[SshHost]:
    """The hosts of a hostfile, in order: a host per line, ``slots=N`` after it, ``#`` comments
    and blank lines ignored."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise SettingsRefused(f"--hostfile {path}: the file does not exist", hint="check the path") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SettingsRefused(f"--hostfile {path} cannot be read ({error})", hint="give a text file") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path}, line {number}"
        name, rest = words[0], words[1:]
        if not _HOST.match(name):
            raise SettingsRefused(f"{where}: {name!r} is not a host", f"the line: {line.strip()}",
                                  "a line is a host name or address, then slots=N")  # fmt: skip
        slots = None
        for word in rest:
            key, equals, value = word.partition("=")
            if key != "slots" or not equals:
                raise SettingsRefused(
                    f"{where}: {word!r} is not understood",
                    f"the line: {line.strip()}\nafter the host, a line may say slots=N (the processes on that host).",
                    "write it as: gpu1 slots=4",
                )
            slots = _slots(value, where)
        hosts.append(SshHost(name, slots))
    if not hosts:
        raise SettingsRefused(f"--hostfile {path} names no host", hint="one host per line, e.g. gpu1 slots=4")
    return _checked(hosts, f"--hostfile {path}")


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise SettingsRefused(f"{where}: slots {text!r} is not a positive whole number", hint="for example slots=4")
    return int(text)


def _checked(hosts: list[SshHost], where: str) -> list[SshHost]:
    seen: set[str] = set()
    for host in hosts:
        if host.label in seen:
            raise SettingsRefused(
                f"{where}: the host {host.label} is named twice",
                "each host runs one phalanx run, which starts all of that host's worker processes.",
                "name each host once, with slots=N (or :N) for its processes",
            )
        seen.add(host.label)
    return hosts
