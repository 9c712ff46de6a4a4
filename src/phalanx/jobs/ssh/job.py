"""``phalanx launch``'s settings as an :class:`SshJob`, the command each host runs, and the launch:
settings checked here, the preflight on every host, then ``phalanx run`` everywhere."""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import secrets
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from phalanx.console import say
from phalanx.errors import SettingsRefused
from phalanx.exit_codes import ExitCode
from phalanx.jobs import run_arguments
from phalanx.jobs.inherited import refuse_torchrun_markers
from phalanx.jobs.ssh.fanout import run_on_hosts
from phalanx.jobs.ssh.hosts import SshHost, parse_host_list, read_hostfile
from phalanx.jobs.ssh.preflight import run_preflight
from phalanx.jobs.ssh.transport import Ssh
from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.options import CONFIG_VARIABLE, given_settings, refuse_settings
from phalanx.settings.values import DEFAULT_RDZV_PORT, Resolved

#: Variables passed on to every host unless --no-default-env: NCCL's, Gloo's, Python's and phalanx's own.
FORWARDED = ("NCCL_*", "GLOO_*", "PYTHON*", "PHALANX_*", "PET_*")
#: Launch options phalanx launch sets itself on every host.
_SET_HERE = ("nnodes", "nproc_per_node", "rdzv_endpoint", "rdzv_id", "dry_run")
#: Launch options that describe a run on this machine alone.
_NOT_FOR_HOSTS = {"simulate_nodes": "rehearses several nodes on this machine",
                  "standalone": "means one node with a private rendezvous",
                  "headless_service": "is for the pods of a Kubernetes Indexed Job"}  # fmt: skip


@dataclass(frozen=True)
class SshJob:
    """A job over ssh: the hosts, each host's processes, the endpoint's port, what runs there."""

    hosts: tuple[SshHost, ...]
    nproc: str  # on every host
    port: int
    endpoint_host: str | None  # --rdzv-endpoint's host; None: the preflight finds one
    rdzv_id: str
    python: str
    cwd: str
    run_args: tuple[str, ...]  # phalanx run's flags and the script with its arguments, less those set per job
    files: dict[str, str | None]  # the script and config file: path -> SHA-256 here (None: not here)
    environment: dict[str, str]
    grace_s: float
    dry_run: bool

    def command(self, endpoint: str) -> str:
        """The shell line each host runs: in the same folder, with the forwarded variables."""
        env = [f"{name}={value}" for name, value in sorted(self.environment.items())]
        run = [self.python, "-m", "phalanx", "run", "--nnodes", str(len(self.hosts)), "--nproc-per-node", self.nproc,
               "--rdzv-endpoint", f"{endpoint}:{self.port}", "--rdzv-id", self.rdzv_id, *self.run_args]  # fmt: skip
        guard = [self.python, "-m", "phalanx.jobs.ssh.remote", "--grace", f"{self.grace_s:g}", "--"]
        return f"cd {shlex.quote(self.cwd)} && exec " + shlex.join(["env", *env, *guard, *run])


def job_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> SshJob:
    """The job ``phalanx launch`` was asked for; refuses what cannot work before connecting."""
    environ = os.environ if environ is None else environ
    hosts = _hosts(args)
    entrypoint = Entrypoint.from_args(args, "phalanx launch --hosts h1,h2 [options] train.py [ARGS...]")
    # The hosts resolve PHALANX_<FLAG> and PET_<FLAG> from what they get; so is the plan here.
    environment = _environment(environ, args.env, default=not args.no_default_env)
    given = {item.partition("=")[0] for item in args.env}
    refuse_torchrun_markers({name: value for name, value in environment.items() if name not in given},
                            "phalanx launch passes this shell's PET_ variables to every host")  # fmt: skip
    refuse_torchrun_markers({name: value for name, value in environment.items() if name in given},
                            "phalanx launch passes --env's variables to every host", "given by --env",
                            drop="leave out --env")  # fmt: skip
    settings, config_path, _ = given_settings(args, environ, variables=environment)
    refuse_settings(settings, _NOT_FOR_HOSTS, "phalanx launch", "phalanx launch runs one node on each host it is given")
    if "nnodes" in settings and (settings["nnodes"].value.min, settings["nnodes"].value.max) != (len(hosts),) * 2:
        raise SettingsRefused(
            f"{settings['nnodes'].origin} gives {settings['nnodes'].value} nodes, but {len(hosts)} hosts are named",
            "phalanx launch runs one node on each host.", "drop --nnodes: the host list says how many nodes there are"
        )  # fmt: skip
    endpoint = settings["rdzv_endpoint"].value if "rdzv_endpoint" in settings else None
    if endpoint is not None and ":" in endpoint.host:
        raise SettingsRefused(f"{settings['rdzv_endpoint'].origin}: {endpoint} is an IPv6 address",
                              "phalanx launch's preflight reaches hosts over IPv4.",
                              "leave --rdzv-endpoint out (the first host's address is found), or give its IPv4 "
                              "address")  # fmt: skip
    files = {} if args.module else {args.training_script: _sha256(Path(args.training_script))}
    if config_path is not None:
        files[str(config_path)] = _sha256(config_path)
    run_args = run_arguments(args, (*_SET_HERE, *_NOT_FOR_HOSTS), config_path, entrypoint)
    rdzv_id = str(settings["rdzv_id"].value) if "rdzv_id" in settings else f"launch-{secrets.token_hex(4)}"
    return SshJob(
        hosts=tuple(hosts),
        nproc=_nproc(hosts, settings.get("nproc_per_node")),
        port=endpoint.port if endpoint else DEFAULT_RDZV_PORT,
        endpoint_host=endpoint.host if endpoint else None,
        rdzv_id=rdzv_id,
        python=args.remote_python or sys.executable,
        cwd=_working_folder(environ),
        run_args=tuple(run_args),
        files=files,
        environment=environment,
        grace_s=args.grace,
        dry_run=bool(settings["dry_run"].value) if "dry_run" in settings else False,
    )


def launch(job: SshJob, ssh: Ssh, preflight_timeout_s: float) -> int:
    """The preflight on every host, its table, then ``phalanx run`` on each (or, with --dry-run,
    the command each would run); returns the job's exit code (:func:`.fanout.run_on_hosts`)."""
    ssh.check()
    found = run_preflight(job, ssh, preflight_timeout_s)
    hosts = f"{len(job.hosts)} host{'s' if len(job.hosts) > 1 else ''}"
    say(f"phalanx launch: preflight of {hosts} in {found.seconds:.1f} s\n{found.table()}")
    if not found.ok:
        raise found.refusal()
    assert found.endpoint is not None
    command = job.command(found.endpoint)
    if job.dry_run:
        print(f"# on each of {', '.join(host.name for host in job.hosts)}, over ssh:\n{command}")
        return ExitCode.OK
    say(f"phalanx launch: starting phalanx run on {hosts}, endpoint {found.endpoint}:{job.port}, "
        f"rendezvous ID {job.rdzv_id}")  # fmt: skip
    return run_on_hosts(job.hosts, ssh, [command] * len(job.hosts), job.grace_s)


def _hosts(args: argparse.Namespace) -> list[SshHost]:
    if bool(args.hosts) == bool(args.hostfile):
        raise SettingsRefused(
            "both --hosts and --hostfile" if args.hosts else "no hosts given",
            "phalanx launch runs the job on the hosts of one list.",
            "give --hosts h1,h2[:SLOTS] or --hostfile FILE (lines: host slots=N)",
        )
    return parse_host_list(args.hosts) if args.hosts else read_hostfile(Path(args.hostfile))


def _nproc(hosts: list[SshHost], given: Resolved | None) -> str:
    """The processes of every host: its slots, else --nproc-per-node, else 1; the same on all."""
    slots = {host.slots for host in hosts if host.slots is not None}
    shown = ", ".join(f"{host.label}:{host.slots or '-'}" for host in hosts)
    if given is not None:
        value = str(given.value)
        if slots and slots != {int(value) if value.isdigit() else None}:
            raise SettingsRefused(f"{given.origin} is {value}, but the host list gives slots {shown}",
                                  "a host's slots are its worker processes; the two must agree.",
                                  "drop one of them")  # fmt: skip
        return value
    if len(slots) > 1 or (slots and any(host.slots is None for host in hosts)):
        raise SettingsRefused(
            f"the hosts have different slots ({shown})",
            "phalanx runs the same number of processes on every node (its nodes compare --nproc-per-node).",
            "give every host the same slots, or leave slots out and give --nproc-per-node",
        )
    return str(slots.pop()) if slots else "1"


def _environment(environ: Mapping[str, str], names: list[str], default: bool) -> dict[str, str]:
    """The variables every host gets: the defaults' patterns, then ``--env NAME[=VALUE]``."""
    chosen = {k: v for k, v in environ.items() if default and any(fnmatch.fnmatchcase(k, p) for p in FORWARDED)}
    chosen.pop(CONFIG_VARIABLE, None)  # a path on this machine; --config is passed on as a flag
    for item in names:
        name, equals, value = item.partition("=")
        if not name.isidentifier():
            raise SettingsRefused(
                f"--env {item}: {name!r} is not a variable name", hint="--env NAME or --env NAME=VALUE"
            )
        if name == CONFIG_VARIABLE:
            raise SettingsRefused(f"--env {item}: the config file is read here, and passed on to every host",
                                  f"{CONFIG_VARIABLE} names a file on this machine, which launch checks before it "
                                  "starts anything.", "give it as --config FILE")  # fmt: skip
        if equals:
            chosen[name] = value
        elif name in environ:
            chosen[name] = environ[name]
        else:
            raise SettingsRefused(f"--env {name}: it is not set here", "--env NAME passes this machine's value on.",
                                  f"set it first, or give the value: --env {name}=VALUE")  # fmt: skip
    return chosen


def _working_folder(environ: Mapping[str, str]) -> str:
    """This folder as the shell names it ($PWD, symbolic links kept: /home may be a link to
    different places on different hosts), else as the kernel does."""
    shown = environ.get("PWD")
    try:
        if shown and os.path.samefile(shown, os.getcwd()):
            return shown
    except OSError:
        pass
    return os.getcwd()


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None  # launched from a machine without it: the hosts' copies are compared to the first's
    except OSError as error:
        raise SettingsRefused(f"{path} cannot be read here ({error.strerror})", hint="check its permissions") from None
