"""Facts of one machine that are known traps for distributed training, each with a HINT.

Each check reads the env report's facts, never the system, so the doctor can run them on every
node's report; differences between nodes are the doctor's to find.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.diagnostics.machine import HostFacts, InfinibandPort, InterfaceFacts, LimitFacts, ShmFacts
from phalanx.diagnostics.torch_facts import GpuReport, TorchFacts
from phalanx.launch import name_lookup, network
from phalanx.launch.failure import SHM_REMEDY
from phalanx.torch_compat import install_hint, outside_range, unsure_features

#: Below this /dev/shm is too small for NCCL's shared-memory transport and DataLoader workers.
MIN_SHM_BYTES = 1024**3
#: Below this soft limit a job of a few dozen ranks with DataLoader workers runs out of descriptors.
MIN_OPEN_FILES = 4096


@dataclass(frozen=True)
class Finding:
    """One trap: what this machine has, why it hurts, what to do (printed as WARNING + HINT)."""

    topic: str  # a short stable key, e.g. "hostname-loopback", for tools that read the JSON
    what: str
    why: str
    hint: str
    between_machines: bool = False  # harmless where every node of a job is on this machine


def hostname_trap(host: HostFacts) -> list[Finding]:
    if not host.hostname_addresses:
        return [
            Finding(
                "hostname-unresolved",
                f"the hostname {host.hostname!r} does not resolve to an address on this machine",
                "plain torchrun hands the hostname to the workers as MASTER_ADDR, and they cannot look it up.",
                "add the hostname with this machine's network address to /etc/hosts (or DNS); "
                "phalanx run advertises the address itself",
            )
        ]
    if not host.hostname_is_loopback:
        return []
    addresses = ", ".join(host.hostname_addresses)
    return [
        Finding(
            "hostname-loopback",
            f"the hostname {host.hostname!r} resolves to {addresses}, a loopback address (the /etc/hosts trap)",
            "harmless on one node; in a multi-node job, tools that advertise the hostname (plain torchrun's "
            "rendezvous and MASTER_ADDR) send the other nodes to 127.x, each node itself, and the job hangs.",
            "give --rdzv-endpoint as the main node's IP address: phalanx run then advertises the routed address, "
            "not the hostname; for other tools map the hostname to the network address in /etc/hosts",
            between_machines=True,
        )
    ]


def name_lookup_trap(host: HostFacts) -> list[Finding]:
    if not name_lookup.is_slow(host.name_lookup_s):
        return []
    address = host.name_lookup_address
    return [
        Finding("name-lookup-slow", name_lookup.slow_text(host.name_lookup_s, address), name_lookup.WHY,
                name_lookup.hint(address))
    ]  # fmt: skip


def torch_range_traps(torch: TorchFacts) -> list[Finding]:
    """A torch outside the tested range, and the private names phalanx uses that it lacks."""
    if torch.version == "not installed":
        return []
    findings = []
    untested = outside_range(torch.version)
    if untested:
        findings.append(Finding(
            "torch-untested",
            f"torch {torch.version} is {untested}",
            "where torch has no public way, phalanx uses private torch names, which may be gone or behave "
            f"otherwise on this release; unsure: {'; '.join(unsure_features())}.",
            f"{install_hint()}, or run the job once under `phalanx run --simulate-nodes 2` to see it work",
        ))  # fmt: skip
    if torch.missing_private:
        findings.append(Finding(
            "torch-private-missing",
            f"torch {torch.version} lacks {len(torch.missing_private)} private name(s) phalanx uses: "
            f"{'; '.join(torch.missing_private)}",
            "the features named in brackets do not work with this torch.",
            install_hint(),
        ))  # fmt: skip
    return findings


def shm_trap(shm: ShmFacts) -> list[Finding]:
    if shm.total_bytes is None or shm.total_bytes >= MIN_SHM_BYTES:
        return []
    return [
        Finding(
            "shm-small",
            f"{shm.path} holds only {shm.total_bytes / 1024**2:.0f} MiB (Docker's default is 64 MiB)",
            "NCCL passes data between the GPUs of one node through shared memory, and DataLoader workers "
            "(num_workers > 0) hand batches over through it: when it fills they fail with 'unable to allocate "
            "shared memory(shm)' or 'Bus error', or NCCL's 'unhandled system error'.",
            SHM_REMEDY,
        )
    ]


def limit_traps(limits: LimitFacts, infiniband: list[InfinibandPort]) -> list[Finding]:
    findings = []
    soft, hard = limits.open_files_soft, limits.open_files_hard
    if soft is not None and soft < MIN_OPEN_FILES:
        raise_to = "unlimited" if hard is None else str(hard)
        can_raise = hard is None or hard >= MIN_OPEN_FILES
        findings.append(
            Finding(
                "open-files-low",
                f"the open-files limit is {soft} (soft), {raise_to} (hard)",
                "every rank keeps sockets to its peers and every DataLoader worker holds descriptors: larger "
                "jobs fail with 'Too many open files'.",
                f"run ulimit -n {raise_to if can_raise else 65536} in the job's shell before phalanx run"
                + ("" if can_raise else "; the hard limit is low too: raise nofile in /etc/security/limits.conf"),
            )
        )
    if infiniband and limits.locked_memory_soft is not None:
        findings.append(
            Finding(
                "locked-memory-limited",
                f"this machine has RDMA devices, but locked memory is limited to "
                f"{limits.locked_memory_soft // 1024} KiB",
                "NCCL's InfiniBand/RoCE transport pins its buffers; with a low limit it fails to register memory "
                "or falls back to TCP sockets.",
                "ulimit -l unlimited (docker run --ulimit memlock=-1, or memlock in /etc/security/limits.conf)",
            )
        )
    return findings


def infiniband_trap(infiniband: list[InfinibandPort]) -> list[Finding]:
    if not infiniband or any(port.state == "ACTIVE" for port in infiniband):
        return []
    listing = ", ".join(f"{port.device} port {port.port} {port.state}" for port in infiniband)
    return [
        Finding(
            "infiniband-down",
            f"no InfiniBand/RoCE port is ACTIVE ({listing})",
            "NCCL then falls back to TCP sockets, typically 10 to 50 times slower.",
            "check the cable and the subnet manager (ibstat shows the port state), or set NCCL_IB_DISABLE=1 "
            "to use sockets on purpose",
        )
    ]


def driver_trap(torch: TorchFacts, gpus: GpuReport) -> list[Finding]:
    if gpus.driver == "none" or torch.cuda_build is not None or torch.hip_build is not None:
        return []
    return [
        Finding(
            "torch-cpu-build",
            f"this machine has the NVIDIA driver {gpus.driver}, but torch {torch.version} is a CPU-only build",
            "a CPU-only torch cannot use the GPUs: training runs on the CPU, with gloo.",
            "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu126, "
            "or the CUDA version your driver supports)",
        )
    ]


def interface_variable_traps(variables: dict[str, str], interfaces: list[InterfaceFacts]) -> list[Finding]:
    names = sorted(interface.name for interface in interfaces)
    findings = []
    for variable in network.INTERFACE_VARIABLES:
        value = variables.get(variable)
        if not value or value.startswith("^"):  # NCCL's "^docker,lo" excludes interfaces, it names none
            continue
        matches = _nccl_matches if variable == "NCCL_SOCKET_IFNAME" else _gloo_matches
        missing = [pattern for pattern in value.split(",") if pattern and not matches(pattern, names)]
        if missing:
            findings.append(
                Finding(
                    "interface-variable-unknown",
                    f"{variable}={value}: this machine has no interface {' or '.join(missing)}",
                    f"the backend fails in init_process_group without it. This machine has: {', '.join(names)}",
                    f"unset {variable} (phalanx run then names the interface that routes to the endpoint), "
                    "or name one of those",
                )
            )
    return findings


def _gloo_matches(pattern: str, names: list[str]) -> bool:
    return pattern in names


def _nccl_matches(pattern: str, names: list[str]) -> bool:
    # NCCL takes prefixes ("eth" means eth0, eth1, ...); a leading "=" asks for the exact name.
    if pattern.startswith("="):
        return pattern[1:] in names
    return any(name.startswith(pattern) for name in names)
