"""The ssh command lines of ``phalanx launch``: the user's own ssh, so that everything in their ssh
config (user, port, identity, jump hosts) applies, with options that make it fail fast and
never ask a question."""

from __future__ import annotations

import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from phalanx.ssh import probe

#: Options that keep ssh from prompting (a password, an unknown host key) and notice a dead
#: connection within 15 s; the user's -o options come after, and the first value ssh reads wins.
_FIXED = ("BatchMode=yes", "ServerAliveInterval=5", "ServerAliveCountMax=3", "LogLevel=ERROR")


@dataclass(frozen=True)
class Ssh:
    """How to reach the hosts: ssh's config file (``-F``), extra ``-o`` options, and how long a
    connection may take to open."""

    config: Path | None = None
    options: tuple[str, ...] = ()
    connect_timeout_s: int = 10

    def argv(self, host: str, remote_command: str) -> list[str]:
        """``ssh ... HOST REMOTE_COMMAND``; the remote command is one shell line."""
        options = [f"ConnectTimeout={self.connect_timeout_s}", *_FIXED, *self.options]
        config = ["-F", str(self.config)] if self.config else []
        return ["ssh", "-T", *config, *(word for option in options for word in ("-o", option)), host, remote_command]

    def resolved_hostname(self, host: str) -> str | None:
        """The address ssh connects to for ``host`` (its config's HostName), from ``ssh -G``."""
        config = ["-F", str(self.config)] if self.config else []
        try:
            shown = subprocess.run(["ssh", "-G", *config, host], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        for line in shown.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname":
                return value.strip()
        return None


def probe_command(python: str, mode: str, request: dict[str, object]) -> str:
    """The remote shell line that runs :mod:`phalanx.ssh.probe` with ``python``."""
    source = Path(probe.__file__).read_text()
    return shlex.join([python, "-c", source, mode, json.dumps(request)])
