"""The env report as text for a person: one section per subject, aligned tables, then the traps."""

from __future__ import annotations

from collections.abc import Sequence

from phalanx.console import format_table
from phalanx.diagnostics.env_report import EnvReport
from phalanx.diagnostics.launch_settings import JsonValue
from phalanx.diagnostics.machine import VARIABLE_NAMES, VARIABLE_PREFIXES
from phalanx.launch import name_lookup
from phalanx.launch.network import speed_text
from phalanx.torch_compat import outside_range, tested_range

VARIABLES_TITLE = f"variables ({', '.join([prefix + '*' for prefix in VARIABLE_PREFIXES] + list(VARIABLE_NAMES))})"
SETTINGS_TITLE = (
    "launch settings (what phalanx run would use here before its flags: PET_<FLAG>, PHALANX_<FLAG>, --config, "
    "the cluster environment, default)"
)


def render(report: EnvReport) -> str:
    sections = [
        ("host", _host(report)),
        ("torch", _torch(report)),
        ("gpus", _gpus(report)),
        ("network interfaces", _interfaces(report)),
        ("infiniband", _infiniband(report)),
        ("resources", _resources(report)),
        (VARIABLES_TITLE, _variables(report)),
        ("cluster environment (what phalanx run reads from the scheduler's variables)", _cluster(report)),
        (SETTINGS_TITLE, _settings(report)),
    ]
    parts = [f"phalanx env: {report.host.hostname} (phalanx {report.phalanx})"]
    parts += [f"{title}\n{body}" for title, body in sections]
    findings = [f"WARNING: {finding.what}\n  {finding.why}\nHINT: {finding.hint}" for finding in report.findings]
    parts.append("\n\n".join(findings) or "no known trap found on this machine")
    return "\n\n".join(parts)


def _cluster(report: EnvReport) -> str:
    cluster = report.cluster
    if cluster.refused:
        return f"  {cluster.description}: {cluster.refused}\n  HINT: {cluster.hint}"
    if cluster.name is None:
        return f"  {cluster.description}"
    rows = [("environment", cluster.description), *cluster.values.items(), ("read", ", ".join(cluster.sources))]
    return _pairs(rows)


def _pairs(rows: Sequence[Sequence[object]]) -> str:
    # A name-value list is a table whose first row needs no header: align it as one.
    return format_table(rows[0], rows[1:])


def size_text(size: int | None) -> str:
    if size is None:
        return "unknown"
    if size >= 1024**3:
        return f"{size / 1024**3:.1f} GiB"
    return f"{size / 1024**2:.0f} MiB"


def _host(report: EnvReport) -> str:
    host = report.host
    if not host.hostname_addresses:
        resolves = "does not resolve (see WARNING below)"
    else:
        trap = " (loopback: see WARNING below)" if host.hostname_is_loopback else ""
        resolves = f"resolves to {', '.join(host.hostname_addresses)}{trap}"
    usable = f" ({host.cpus_usable} usable by this process)" if host.cpus_usable not in (None, host.cpus) else ""
    return _pairs(
        [
            ("hostname", f"{host.hostname}, {resolves}"),
            ("fqdn", host.fqdn),
            ("name lookup", _lookup_text(host.name_lookup_s, host.name_lookup_address)),
            ("os", f"{host.os}, kernel {host.kernel}, {host.arch}"),
            ("cpus", f"{host.cpus if host.cpus is not None else 'unknown'}{usable}"),
            ("memory", size_text(host.memory_bytes)),
            ("python", f"{host.python} ({host.python_implementation}, {host.python_executable})"),
        ]
    )


def _lookup_text(seconds: float, address: str) -> str:
    bound = "at least " if seconds >= name_lookup.LIMIT_S else ""
    slow = " (slow: see WARNING below)" if name_lookup.is_slow(seconds) else ""
    return f"{bound}{seconds * 1000:.0f} ms for the name of {address}, as torch's store client asks it{slow}"


def _torch(report: EnvReport) -> str:
    torch = report.torch
    if torch.cuda_build or torch.hip_build:
        kind = f"CUDA {torch.cuda_build}" if torch.cuda_build else f"ROCm {torch.hip_build}"
        usable = "available" if torch.cuda_available else "not available (no usable driver, or no GPU visible)"
        cuda = f"{kind} build, {usable}"
    else:
        cuda = "none: a CPU-only build"
    backends = ", ".join(f"{name} {'yes' if available else 'no'}" for name, available in torch.backends().items())
    return _pairs(
        [
            (
                "version",
                f"{torch.version} ({outside_range(torch.version) or f'phalanx is tested with {tested_range()}'})",
            ),
            ("cuda", cuda),
            ("cudnn", torch.cudnn or "none"),
            ("nccl", torch.nccl or "none (not in this build)"),
            ("backends", backends if torch.distributed_available else "none: torch.distributed is not in this build"),
        ]
    )


def _gpus(report: EnvReport) -> str:
    gpus = report.gpus
    driver = "none (no NVIDIA driver loaded)" if gpus.driver == "none" else gpus.driver
    if not gpus.devices:
        return _pairs([("devices", "none: torch sees no GPU"), ("driver", driver)])
    rows = [(gpu.index, gpu.name, size_text(gpu.memory_bytes), gpu.capability) for gpu in gpus.devices]
    return _pairs([("driver", driver)]) + "\n" + format_table(("index", "name", "memory", "capability"), rows)


def _interfaces(report: EnvReport) -> str:
    rows = [
        (
            interface.name,
            "up" if interface.is_up else "down",
            ", ".join(interface.addresses) or "-",
            interface.mtu if interface.mtu is not None else "unknown",
            speed_text(interface.speed_mbps),
            "loopback" if interface.is_loopback else "",
        )
        for interface in report.interfaces
    ]
    return format_table(("name", "state", "addresses", "mtu", "speed", "note"), rows)


def _infiniband(report: EnvReport) -> str:
    if not report.infiniband:
        return "  none (no RDMA device in /sys/class/infiniband)"
    rows = [(p.device, p.port, p.state, p.phys_state, p.rate, p.link_layer) for p in report.infiniband]
    return format_table(("device", "port", "state", "physical", "rate", "link layer"), rows)


def _resources(report: EnvReport) -> str:
    shm, limits = report.shm, report.limits

    def limit(value: int | None, unit: str = "") -> str:
        return "unlimited" if value is None else f"{value}{unit}"

    shm_text = f"{size_text(shm.total_bytes)}, {size_text(shm.free_bytes)} free"
    if shm.total_bytes is None:
        shm_text = "unknown (not mounted?)"
    locked = [None if v is None else v // 1024 for v in (limits.locked_memory_soft, limits.locked_memory_hard)]
    return _pairs(
        [
            (shm.path, shm_text),
            ("open files", f"{limit(limits.open_files_soft)} (soft), {limit(limits.open_files_hard)} (hard)"),
            ("locked memory", f"{limit(locked[0], ' KiB')} (soft), {limit(locked[1], ' KiB')} (hard)"),
        ]
    )


def _variables(report: EnvReport) -> str:
    if not report.variables:
        return "  none set"
    return format_table(("name", "value"), list(report.variables.items()))


def _settings(report: EnvReport) -> str:
    rows = []
    for setting in report.settings:
        value = _value_text(setting.value) + ("  (refused: see the error below)" if setting.refused else "")
        origin = "default" if setting.source == "default" else setting.origin
        rows.append((setting.flag, value, origin))
    return format_table(("setting", "value", "from"), rows)


def _value_text(value: JsonValue) -> str:
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:g}" if isinstance(value, float) else str(value)
