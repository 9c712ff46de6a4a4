"""The env report: one machine's facts as one JSON document, and the part to compare across nodes.

:func:`collect_env_report` never raises for what a machine lacks (no GPU, no /sys file, no
InfiniBand): the fact is recorded as ``"unknown"`` (text), ``None`` (a number) or an empty list.
Apart from importing torch it takes a few milliseconds (up to
:data:`~phalanx.launch.name_lookup.LIMIT_S` more where the name server is silent), so the doctor
calls it on every rank.

The JSON document (:meth:`EnvReport.to_json`), schema 1; its keys are stable (new keys may be
added, none renamed without raising ``schema``):

``schema``        1
``phalanx``       phalanx's version
``host``          hostname, fqdn, hostname_addresses (what the hostname resolves to, IPv4 first),
                  hostname_is_loopback, os, kernel, arch, cpus, cpus_usable, memory_bytes,
                  python, python_implementation, python_executable, name_lookup_address (an
                  address of this machine's that its peers see), name_lookup_s (seconds a lookup
                  of its name takes, as torch's store client makes it)
``torch``         version, cuda_build, hip_build (None: not in this build), cuda_available, cudnn,
                  nccl (None: not in this build), distributed_available, gloo_available,
                  nccl_available, mpi_available, missing_private (the private torch names phalanx
                  uses that this torch lacks, each with the feature that needs it)
``gpus``          driver ("none" without an NVIDIA driver), devices: [{index, name, memory_bytes,
                  capability}] (empty without GPUs)
``interfaces``    [{name, is_up, is_loopback, addresses, mtu, speed_mbps}] (speed None: unknown)
``infiniband``    [{device, port, state, phys_state, rate, link_layer}]
``shm``           path, total_bytes, free_bytes
``limits``        open_files_soft, open_files_hard, locked_memory_soft, locked_memory_hard (None: unlimited)
``variables``     {NAME: value} of the set variables whose names start with
                  :data:`~phalanx.diagnostics.machine.VARIABLE_PREFIXES` or are in
                  :data:`~phalanx.diagnostics.machine.VARIABLE_NAMES`
``config_file``   the --config file the settings were read from, or None
``cluster``       name (SLURM, ..., None without one), description, values {nnodes, node_rank,
                  endpoint, rdzv_id, nproc_per_node, hosts}, sources, refused, hint: the cluster
                  environment phalanx run would detect here
``settings``      [{flag, value, source, origin, refused, hint}]: what `phalanx run` would use,
                  source "environment", "config" or "default"
``findings``      [{topic, what, why, hint, between_machines}]: known traps on this machine
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx import __version__
from phalanx.diagnostics import launch_settings, machine, torch_facts, traps
from phalanx.diagnostics.cluster_facts import ClusterFacts, cluster_facts
from phalanx.diagnostics.launch_settings import ResolvedSetting
from phalanx.diagnostics.machine import HostFacts, InfinibandPort, InterfaceFacts, LimitFacts, ShmFacts
from phalanx.diagnostics.torch_facts import GpuReport, TorchFacts
from phalanx.diagnostics.traps import Finding
from phalanx.settings.options import CONFIG_VARIABLE, LAUNCH_OPTIONS
from phalanx.worker_env import WorkerEnv

SCHEMA = 1

#: Variables that differ between nodes (or ranks) of a healthy job, left out of the comparison:
#: torchrun's per-rank numbers, the per-node interface and GPU mask, phalanx's per-process ones,
#: the node's own paths and interface name given to phalanx, SLURM's per-node and per-task ones.
#: (The GPUs and CPUs themselves are compared as facts of their own.)
PER_NODE_VARIABLES = (
    "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
    *WorkerEnv.per_process_keys(), *(o.env_var for o in LAUNCH_OPTIONS if o.field == "interface"), CONFIG_VARIABLE,
    "SLURM_NODEID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_TASK_PID", "SLURMD_NODENAME", "SLURM_GTIDS",
    "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_CPUS_ON_NODE", "SLURM_TOPOLOGY_ADDR",
    "PET_NODE_RANK", "SKYPILOT_NODE_RANK", "JOB_COMPLETION_INDEX",
)  # fmt: skip


@dataclass(frozen=True)
class EnvReport:
    phalanx: str
    host: HostFacts
    torch: TorchFacts
    gpus: GpuReport
    interfaces: tuple[InterfaceFacts, ...]
    infiniband: tuple[InfinibandPort, ...]
    shm: ShmFacts
    limits: LimitFacts
    variables: dict[str, str]
    config_file: str | None
    cluster: ClusterFacts
    settings: tuple[ResolvedSetting, ...]
    findings: tuple[Finding, ...]

    def to_json(self) -> dict[str, Any]:
        """The report as a reader of the JSON document gets it: dicts, lists (not tuples), text, numbers."""
        return json.loads(json.dumps({"schema": SCHEMA, **dataclasses.asdict(self)}))

    @property
    def refused_settings(self) -> list[ResolvedSetting]:
        return [setting for setting in self.settings if setting.refused]


def collect_env_report(
    environ: Mapping[str, str] | None = None,
    config: Mapping[str, object] | None = None,
    config_path: Path | None = None,
    root: Path = Path("/"),
) -> EnvReport:
    """This machine's report. ``config`` is the already-read --config file (see
    :func:`phalanx.settings.options.read_config`), ``root`` the folder /sys, /proc, /etc and /dev are read under."""
    environ = os.environ if environ is None else environ
    host = machine.host_facts(root)
    torch = torch_facts.torch_facts()
    gpus = torch_facts.gpu_report(root=root) if torch.version != "not installed" else GpuReport("unknown", ())
    interfaces = machine.interface_facts(root)
    infiniband = machine.infiniband_ports(root)
    shm = machine.shm_facts(root)
    limits = machine.limit_facts()
    variables = machine.distributed_variables(environ)
    findings = [
        *traps.hostname_trap(host),
        *traps.name_lookup_trap(host),
        *traps.torch_range_traps(torch),
        *traps.driver_trap(torch, gpus),
        *traps.interface_variable_traps(variables, interfaces),
        *traps.infiniband_trap(infiniband),
        *traps.shm_trap(shm),
        *traps.limit_traps(limits, infiniband),
    ]
    return EnvReport(
        phalanx=__version__,
        host=host,
        torch=torch,
        gpus=gpus,
        interfaces=tuple(interfaces),
        infiniband=tuple(infiniband),
        shm=shm,
        limits=limits,
        variables=variables,
        config_file=str(config_path) if config_path else None,
        cluster=cluster_facts(environ),
        settings=tuple(launch_settings.resolved_settings(environ, config or {}, config_path)),
        findings=tuple(findings),
    )


def comparable_facts(report: EnvReport) -> dict[str, str]:
    """The facts that must be equal on every node of one job, as flat text (key -> value).

    Versions, the GPUs and the variables that steer the backends; a variable set on some nodes
    only appears as a key on those (compare the union of keys, missing meaning unset).
    """
    facts = {
        "phalanx": report.phalanx,
        "python": report.host.python,
        "torch": report.torch.version,
        "cuda build": report.torch.cuda_build or "none",
        "cudnn": report.torch.cudnn or "none",
        "nccl": report.torch.nccl or "none",
        "backends": ",".join(name for name, available in report.torch.backends().items() if available),
        "gpu driver": report.gpus.driver,
        "gpu count": str(len(report.gpus.devices)),
        "gpu names": ", ".join(gpu.name for gpu in report.gpus.devices),
    }
    facts.update({f"env {name}": value for name, value in report.variables.items() if name not in PER_NODE_VARIABLES})
    return facts
