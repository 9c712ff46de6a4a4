"""The same launch settings, given any way, make the same job through every command.

Each command that starts a job (run, launch, slurm, k8s) is asked for 2 nodes of 3 processes
with 2 restarts, by flags, --config, $PHALANX_CONFIG, PHALANX_<FLAG> or PET_<FLAG> variables.
What every node would then run is resolved as `phalanx run` on that node resolves it: the
command line each command writes, in the environment the node gets (launch's forwarded
variables, the batch job's inherited ones, the pod's). Kubernetes pods do not inherit this
shell's variables, so `phalanx k8s` takes the variables as ``--env``.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from phalanx.cli.main import build_parser
from phalanx.errors import SettingsRefused
from phalanx.jobs.k8s.settings import spec_from_args as k8s_spec
from phalanx.jobs.slurm.job import job_from_args as slurm_job
from phalanx.jobs.ssh.job import job_from_args as ssh_job
from phalanx.launch.options import spec_from_args
from phalanx.settings.values import NodeRange
from tests.unit.test_clusters import SLURM_STEP

WANTED = {"nnodes": "2", "nproc-per-node": "3", "max-restarts": "2"}
WAYS = ("flags", "--config", "PHALANX_CONFIG", "PHALANX_<FLAG>", "PET_<FLAG>")
COMMANDS = ("run", "launch", "slurm", "k8s")


def given(way: str, config: Path) -> tuple[list[str], dict[str, str]]:
    """The command-line flags and this shell's variables for one way of giving the settings."""
    if way == "flags":
        return [arg for flag, value in WANTED.items() for arg in (f"--{flag}", value)], {}
    if way == "--config":
        return ["--config", str(config)], {}
    if way == "PHALANX_CONFIG":
        return [], {"PHALANX_CONFIG": str(config)}
    prefix = "PHALANX_" if way == "PHALANX_<FLAG>" else "PET_"
    return [], {prefix + flag.upper().replace("-", "_"): value for flag, value in WANTED.items()}


def run_args(argv: list[str]) -> list[str]:
    """The arguments after ``phalanx run`` (or ``python -m phalanx run``) in a node's command."""
    return argv[argv.index("run") + 1 :]


def node_sees(command: str, flags: list[str], shell: dict[str, str], script: str, monkeypatch) -> tuple:
    """What `phalanx run` resolves on a node of the job the command writes."""
    parse = build_parser().parse_args
    if command == "run":
        node_argv, node_env = [*flags, "--rdzv-endpoint", "10.0.0.1:29400", script], shell
    elif command == "launch":
        job = ssh_job(parse(["launch", "--hosts", "h1,h2", *flags, script]), shell)
        line = shlex.split(job.command("10.0.0.1").split(" && exec ", 1)[1])
        node_env = dict(item.split("=", 1) for item in line[1 : line.index(job.python)])
        node_argv = run_args(line[line.index("--") + 1 :])
    elif command == "slurm":
        for name, value in shell.items():
            monkeypatch.setenv(name, value)
        job = slurm_job(parse(["slurm", *flags, script]))
        assert job.nodes == NodeRange(2, 2)  # the batch script asks SLURM for the nodes
        node_argv, node_env = run_args(list(job.run_command)), {**shell, **SLURM_STEP}
    else:
        # The pods see the manifest's variables only: this shell's go in as --env.
        pod_vars = [
            arg for name, value in shell.items() if name != "PHALANX_CONFIG" for arg in ("--env", f"{name}={value}")
        ]
        with monkeypatch.context() as patched:
            for name, value in shell.items():
                if name == "PHALANX_CONFIG":
                    patched.setenv(name, value)
            spec = k8s_spec(parse(["k8s", "--kind", "indexed-job", "--image", "me/train:1", *pod_vars, *flags, script]))
        _, job = spec.kind.render(spec)
        container = job["spec"]["template"]["spec"]["containers"][0]
        pod_env = {item["name"]: item["value"] for item in container.get("env", [])}
        pod = {"JOB_COMPLETION_INDEX": "1", "HOSTNAME": f"{spec.name}-1"}  # what the Job controller gives pod 1
        node_argv, node_env = run_args(container["command"]), {**pod_env, **pod}
    spec = spec_from_args(parse(["run", *node_argv]), node_env)
    return spec.nnodes, spec.nproc_per_node, spec.max_restarts


def prepared(tmp_path, monkeypatch) -> tuple[str, Path]:
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("PHALANX_", "PET_", "SLURM_")):
            monkeypatch.delenv(name)
    script = tmp_path / "train.py"
    script.write_text("")
    config = tmp_path / "launch.toml"
    config.write_text("[run]\n" + "".join(f"{flag.replace('-', '_')} = {value}\n" for flag, value in WANTED.items()))
    return str(script), config


#: Where torchrun's PET_ variables cannot describe the job: every node would inherit the same
#: ones (the batch job's nodes, launch's hosts) beside what each node is given, and an Indexed
#: Job's shape is the manifest's.
REFUSED = {
    ("PET_<FLAG>", "slurm"): "PET_NNODES=2 set in this shell",
    ("PET_<FLAG>", "launch"): "PET_NNODES=2 set in this shell",
    ("PET_<FLAG>", "k8s"): "--env PET_NNODES",
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("way", WAYS)
def test_every_way_gives_every_command_the_same_job(command, way, tmp_path, monkeypatch):
    script, config = prepared(tmp_path, monkeypatch)
    flags, shell = given(way, config)
    if (way, command) in REFUSED:
        with pytest.raises(SettingsRefused, match=re.escape(REFUSED[way, command])) as refused:
            node_sees(command, flags, shell, script, monkeypatch)
        assert refused.value.hint, str(refused.value)
    else:
        assert node_sees(command, flags, shell, script, monkeypatch) == (NodeRange(2, 2), 3, 2)
