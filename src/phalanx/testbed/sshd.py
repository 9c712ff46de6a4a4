"""OpenSSH's sshd on every host of a test bed, for rehearsing and testing ``phalanx launch``.

Keys are made for the occasion, and an ssh config file names each host as a user's
``~/.ssh/config`` would. ``private`` folders let hosts hold different files at one path, as
machines without a shared file system do.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import SettingsRefused
from phalanx.testbed.bed import TestBed, TestBedError

#: sshd listens here in every host; not 22, so that the config file's Port is seen to apply.
PORT = 2222
_PRIVILEGE_SEPARATION = Path("/run/sshd")


@dataclass(frozen=True)
class SshBed:
    """A bed whose hosts run sshd: ``ssh -F config HOST`` reaches each by its bed name."""

    bed: TestBed
    config: Path
    #: Each host's sshd: its process ID.
    daemons: dict[str, int]


@contextlib.contextmanager
def sshd_on(
    bed: TestBed, folder: Path, private: Mapping[str, Sequence[tuple[Path, Path]]] | None = None
) -> Iterator[SshBed]:
    """Runs sshd in every host of ``bed`` within the block; stops them afterwards.

    Args:
        bed: a test bed (:func:`phalanx.testbed.test_bed`).
        folder: where keys, the sshd and ssh config files and sshd's logs go.
        private: per host name, ``(source, target)`` folders: ``source`` is mounted over ``target``
            for that host's sessions.

    Example:
        >>> with test_bed("demo", ["h1", "h2"]) as bed, sshd_on(bed, Path("/tmp/demo")) as hosts:  # doctest: +SKIP
        ...     subprocess.run(["ssh", "-F", str(hosts.config), "h2", "hostname -I"])
    """
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(sshd).exists() or shutil.which("ssh-keygen") is None:
        raise SettingsRefused("sshd or ssh-keygen is missing", hint="apt-get install openssh-server openssh-client")
    folder.mkdir(parents=True, exist_ok=True)
    _PRIVILEGE_SEPARATION.mkdir(mode=0o755, exist_ok=True)
    for key in ("host_key", "client_key"):
        if not (folder / key).exists():
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True, timeout=30
            )
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    (folder / "sshd_config").write_text(_sshd_config(folder))
    config = folder / "ssh_config"
    config.write_text("".join(_client_entry(host.name, host.address, folder) for host in bed.hosts))
    daemons = []
    try:
        for host in bed.hosts:
            mounts = " && ".join(
                f"mount --bind {source} {target}" for source, target in (private or {}).get(host.name, ())
            )
            script = f'{mounts + " && " if mounts else ""}exec "$@"'
            argv = host.command(["sh", "-c", script, "sh", sshd, "-D", "-e", "-f", str(folder / "sshd_config")])
            with (folder / f"sshd-{host.name}.log").open("w") as log:
                daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        for host, daemon in zip(bed.hosts, daemons):
            _wait_until_listening(host.address, daemon, folder / f"sshd-{host.name}.log")
        yield SshBed(bed, config, {host.name: d.pid for host, d in zip(bed.hosts, daemons)})
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()


def _sshd_config(folder: Path) -> str:
    return "\n".join([
        f"Port {PORT}", f"HostKey {folder / 'host_key'}", f"AuthorizedKeysFile {folder / 'authorized_keys'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "PidFile none", "LogLevel ERROR", "MaxStartups 100:30:200", "",
    ])  # fmt: skip


def _client_entry(name: str, address: str, folder: Path) -> str:
    return (f"Host {name}\n  HostName {address}\n  Port {PORT}\n  User root\n  IdentityFile {folder / 'client_key'}\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n")  # fmt: skip


def _wait_until_listening(address: str, daemon: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            break
        with contextlib.suppress(OSError), socket.create_connection((address, PORT), timeout=1):
            return
        time.sleep(0.05)
    raise TestBedError(f"sshd did not start on {address}:{PORT}: {log.read_text().strip()[-500:]}",
                       hint="see the sshd log named above")  # fmt: skip
