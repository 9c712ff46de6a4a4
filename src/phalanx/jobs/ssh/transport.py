"""The ssh command lines of ``phalanx launch``: the user's own ssh, so that everything in their ssh
config (user, port, identity, jump hosts) applies, with options that make it fail fast and
never ask a question."""

from __future__ import annotations

import base64
import json
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import SettingsRefused
from phalanx.jobs.ssh import probe

#: ssh's own exit code when it could not connect or authenticate.
SSH_FAILED = 255
#: ssh never prompts (a password, an unknown host key): a prompt nobody answers would hang.
_FORCED = ("BatchMode=yes",)
#: Defaults that open a connection within 10 s and notice a dead one within 15 s; the user's -o
#: options come first, and the first value ssh reads wins, so theirs apply.
_DEFAULTS = ("ConnectTimeout=10", "ServerAliveInterval=5", "ServerAliveCountMax=3", "LogLevel=ERROR")


@dataclass(frozen=True)
class Ssh:
    """How to reach the hosts: ssh's config file (``-F``) and extra ``-o`` options."""

    config: Path | None = None
    options: tuple[str, ...] = ()

    def argv(self, host: str, remote_command: str) -> list[str]:
        """``ssh ... HOST REMOTE_COMMAND``; the remote command is one shell line."""
        options = [*_FORCED, *self.options, *_DEFAULTS]
        return ["ssh", "-T", *self._config(), *(word for option in options for word in ("-o", option)), host,
                remote_command]  # fmt: skip

    def _config(self) -> list[str]:
        return ["-F", str(self.config)] if self.config else []

    def check(self) -> None:
        """Refuses, before anything connects, where this machine has no ssh client."""
        if shutil.which("ssh") is None:
            raise SettingsRefused("phalanx launch needs ssh, which this machine lacks",
                                  "it reaches every host with the ssh client, as you would.",
                                  "install OpenSSH's client (apt-get install openssh-client)")  # fmt: skip

    def resolved_hostname(self, host: str) -> str | None:
        """The address ssh connects to for ``host`` (its config's HostName), from ``ssh -G``."""
        try:
            shown = subprocess.run(["ssh", "-G", *self._config(), host], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        for line in shown.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname":
                return value.strip()
        return None


def probe_command(python: str, mode: str, request: dict[str, object], env: Mapping[str, str]) -> str:
    """The remote shell line that runs :mod:`phalanx.jobs.ssh.probe` with ``python`` and the job's
    variables (``PYTHONPATH`` decides what imports). The source goes as base64 on one line:
    a newline inside quotes is more than csh's login shells take."""
    source = base64.b64encode(Path(probe.__file__).read_bytes()).decode()
    program = f"import base64; exec(base64.b64decode('{source}'))"
    assignments = [f"{name}={value}" for name, value in sorted(env.items())]
    return shlex.join(
        [*(["env", *assignments] if assignments else []), python, "-c", program, mode, json.dumps(request)]
    )
