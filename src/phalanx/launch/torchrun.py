"""A node setup as torchrun's command line and environment: what the agent hands to
torch.distributed.run's parser, and what ``--dry-run`` prints."""

from __future__ import annotations

import math
import shlex

from phalanx.launch.node_setup import NodeSetup

#: The module every worker runs first (phalanx.launch.bootstrap); it runs the user's script.
BOOTSTRAP_MODULE = "phalanx.launch.bootstrap"
#: torchrun reads the console prefix of worker lines from this variable; ${rank} is global.
PREFIX_TEMPLATE_VARIABLE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def torchrun_argv(setup: NodeSetup, *, logs_specs_by_name: bool = True) -> list[str]:
    """``logs_specs_by_name``: name phalanx's log layout by its entry point, as a printed torchrun
    command must; torchrun looks it up among the installed packages' entry points, which a
    phalanx run from a source tree (PYTHONPATH=src) has none of."""
    nnodes = str(setup.nnodes)
    # torch reads its timeouts as whole numbers of seconds
    rdzv_conf = f"is_host={int(setup.is_host)},join_timeout={math.ceil(setup.join_timeout)}"
    if setup.nnodes.is_elastic:
        rdzv_conf += f",last_call_timeout={math.ceil(setup.last_call)}"
    argv = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={setup.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={setup.rdzv_endpoint}",
        f"--rdzv-id={setup.rdzv_id}",
        f"--rdzv-conf={rdzv_conf}",
        f"--local-addr={setup.local_addr}",
        f"--max-restarts={setup.max_restarts}",
        f"--log-dir={setup.run_dir}",
        *(["--logs-specs=phalanx"] if logs_specs_by_name else []),
        "--redirects=3",
        "--tee=3",
    ]
    if setup.all_ranks:
        argv.append(f"--local-ranks-filter={','.join(str(r) for r in range(setup.nproc_per_node))}")
    # Every worker runs the script through phalanx's entry point (it dies with its launcher, and
    # records whether it joined the job's process group): torchrun's own -m, then the script's.
    target = ["-m", setup.script] if setup.is_module else [setup.script]
    return [*argv, "-m", BOOTSTRAP_MODULE, *target, *setup.script_args]


def torchrun_env(setup: NodeSetup) -> dict[str, str]:
    """What the agent adds to the inherited environment (its workers inherit it in turn)."""
    return {**setup.env, PREFIX_TEMPLATE_VARIABLE: f"[{setup.node_label} rank${{rank}}]: "}


def command_line(setup: NodeSetup) -> str:
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in sorted(torchrun_env(setup).items()))
    return f"{env} \\\n  torchrun {shlex.join(torchrun_argv(setup))}"
