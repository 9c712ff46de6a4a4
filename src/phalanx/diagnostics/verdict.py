"""`phalanx doctor`'s verdict: findings drawn from the measurements, each with its HINT.

Pure functions over the report the doctor's rank 0 gathered, so every rule is tested on its
own. A *problem* breaks a job or makes it silently wrong (the exit code is 1); a *warning*
costs speed (the exit code stays 0 unless --strict).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

#: Links slower than this (bytes/s; 2.5 Gbit/s) make data-parallel training wait on the network.
SLOW_LINK_BYTES_PER_S = 2.5e9 / 8
#: A rank this much slower than the median at the same matmul is a straggler: everyone waits for it.
STRAGGLER_RATIO = 0.75
#: Clocks further apart than this make the nodes' logs disagree on what happened first.
CLOCK_OFFSET_S = 1.0
#: Forward and backward of a dense layer cost about 6 FLOPs per parameter per sample.
FLOPS_PER_PARAMETER_SAMPLE = 6
#: Warn when dense steps need per-process batches above this to hide the all-reduce.
BREAK_EVEN_BATCH = 64
#: Another network at least this many times faster than the workers' is worth moving the job to.
FASTER_NETWORK_RATIO = 1.5
#: Differences between nodes that change only logging or speed: warnings, not problems.
HARMLESS_DIFFERENCES = frozenset({
    "gpu driver", "env NCCL_DEBUG", "env NCCL_DEBUG_SUBSYS", "env NCCL_DEBUG_FILE", "env TORCH_CPP_LOG_LEVEL",
    "env TORCH_DISTRIBUTED_DEBUG", "env TORCH_SHOW_CPP_STACKTRACES", "env PHALANX_STALL_TIMEOUT",
})  # fmt: skip


@dataclass(frozen=True)
class Finding:
    severity: str  # "problem" or "warning"
    topic: str
    what: str
    hint: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def node_names(report: dict[str, Any]) -> dict[str, str]:
    """How output names each node: ``node 10.0.0.2``, or ``node1 (127.0.0.102)`` when simulated."""
    return {node["label"]: f"{node['label']} ({node['address']})" if node["address"] != node["label"] else f"node {node['label']}"
            for node in report["nodes"]}  # fmt: skip


def rank_nodes(report: dict[str, Any]) -> dict[int, str]:
    """Global rank -> the label of its node."""
    return {rank["rank"]: rank["node"] for rank in report["ranks"]}


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 'es' if word.endswith('s') else 's'}"


def _severity(key: str, values: dict[str, str]) -> str:
    if key in HARMLESS_DIFFERENCES:
        return "warning"
    if key == "python":  # a patch release apart is harmless; a minor one changes pickles and wheels
        return "problem" if len({".".join(value.split(".")[:2]) for value in values.values()}) > 1 else "warning"
    return "problem"


def fingerprint_findings(report: dict[str, Any]) -> list[Finding]:
    """Every setting that is not the same on all nodes, naming the odd nodes out."""
    names = node_names(report)
    facts = {node["label"]: node["facts"] for node in report["nodes"]}
    findings = []
    for key in sorted({key for node_facts in facts.values() for key in node_facts}):
        values = {label: node_facts.get(key, "(not set)") for label, node_facts in facts.items()}
        if len(set(values.values())) < 2:
            continue
        common, _ = Counter(values.values()).most_common(1)[0]
        odd = [label for label, value in values.items() if value != common]
        described = "; ".join(f"{names[label]} has {key} = {values[label]}" for label in odd)
        severity = _severity(key, values)
        effect = ("nodes that differ can hang in a collective or train on different code" if severity == "problem"
                  else "it changes only logging or speed, but a job is easier to read when every node matches")  # fmt: skip
        findings.append(Finding(
            severity, f"differs:{key}", f"{described}, the others {common}",
            f"install or set the same {key} on every node (phalanx env shows it on each); {effect}",
        ))  # fmt: skip
    return findings


def hostname_findings(report: dict[str, Any]) -> list[Finding]:
    if report["simulated"]:
        return []  # simulated nodes share this host on purpose
    by_host = Counter(node["host"] for node in report["nodes"])
    return [
        Finding(
            "problem",
            "duplicate-hostname",
            f"{count} nodes report the hostname {host!r}",
            "give every machine its own hostname: NCCL and torchrun tell hosts apart by it "
            "(hostnamectl set-hostname NAME)",
        )
        for host, count in by_host.items()
        if count > 1
    ]


def gpu_findings(report: dict[str, Any]) -> list[Finding]:
    findings = []
    for node in report["nodes"]:
        gpus, procs = node["gpus"], node["processes"]
        name = node_names(report)[node["label"]]
        runs, has = _plural(procs, "process"), _plural(gpus, "GPU")
        if report["backend"] == "nccl" and gpus < procs:
            findings.append(Finding("problem", "gpus-short", f"{name} runs {runs} on nccl but has {has}",
                                    f"use --nproc-per-node {gpus} (one process per GPU) on that node"))  # fmt: skip
        elif gpus > procs:
            findings.append(Finding("warning", "gpus-idle", f"{name} has {has} but runs {runs}",
                                    f"use --nproc-per-node {gpus} (or gpu) to train on all of them"))  # fmt: skip
    return findings


def clock_findings(report: dict[str, Any]) -> list[Finding]:
    labels, names = rank_nodes(report), node_names(report)
    return [
        Finding(
            "warning",
            "clock-offset",
            f"{names[labels[c['rank']]]}'s clock is {abs(c['offset_s']):.2f} s {'ahead of' if c['offset_s'] > 0 else 'behind'} "
            "rank 0's",
            "run NTP (chrony or systemd-timesyncd) on every node, so that their logs can be put side by side",
        )
        for c in report["clock_offsets"]
        if abs(c["offset_s"]) > CLOCK_OFFSET_S
    ]


def link_findings(report: dict[str, Any]) -> list[Finding]:
    labels = rank_nodes(report)
    unmeasured = [link for link in report["links"] if link["bandwidth_bytes_per_s"] is None]
    findings = [
        Finding(
            "warning",
            "link-unmeasured",
            f"the link {labels[link['source']]} -> {labels[link['target']]} could not be timed: the transfer took no "
            "longer than a small message's round trip",
            "run again with a larger --p2p-size, on quieter nodes",
        )
        for link in unmeasured
    ]
    links = [link for link in report["links"] if link["bandwidth_bytes_per_s"] is not None]
    if not links:
        return findings
    slowest = min(links, key=lambda link: link["bandwidth_bytes_per_s"])
    rate = slowest["bandwidth_bytes_per_s"]
    ranks = report["world_size"]
    # the fp32 gradient ring all-reduce per step, against the dense compute it must hide behind
    ring_s_per_parameter = 2 * (ranks - 1) / ranks * 4 / rate
    speeds = [c["gflops"] for c in report["compute"]]
    flops = statistics.median(speeds) * 1e9 if speeds else 0.0
    batch = ring_s_per_parameter * flops / FLOPS_PER_PARAMETER_SAMPLE
    if rate < SLOW_LINK_BYTES_PER_S or batch > BREAK_EVEN_BATCH:
        findings.append(Finding(
            "warning", "slow-link",
            f"links measure about {rate * 8 / 1e9:.2g} Gbit/s ({rate / 1e9:.3g} GB/s): the gradient all-reduce costs "
            f"{ring_s_per_parameter * 1e9:.0f} ms per step for every 1 M fp32 parameters, and at the {flops / 1e9:.0f} "
            f"GFLOP/s measured (float32 matmul) a dense model's step computes for less than that with under "
            f"~{batch:.0f} samples (tokens, for a transformer) per process: such steps will wait on the network",
            "compress the gradients, run.setup_model(model, compression=\"powersgd\") (or \"fp16\", half the "
            "bytes, or \"auto\" to time them), and use larger per-process batches; "
            "phalanx plan --from-doctor FILE --params N predicts it for your model",
        ))  # fmt: skip
    others = [link["bandwidth_bytes_per_s"] for link in links if link is not slowest]
    if others and rate < 0.5 * statistics.median(others):
        pair = f"{labels[slowest['source']]} -> {labels[slowest['target']]}"
        findings.append(Finding(
            "warning", "uneven-links",
            f"the link {pair} measures {rate * 8 / 1e9:.2g} Gbit/s, the others about {statistics.median(others) * 8 / 1e9:.2g}",
            "a ring all-reduce runs at the pace of its slowest link: check that pair's cabling, NIC and "
            "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME",
        ))  # fmt: skip
    return findings


def _gbit(figure: dict[str, Any]) -> str:
    return f"{figure['bandwidth_bytes_per_s'] * 8 / 1e9:.2g} Gbit/s"


def network_findings(report: dict[str, Any]) -> list[Finding]:
    """A network that connects every node and measures faster than the workers' traffic does; a
    network that connects some pairs of nodes but not others (or not the workers')."""
    labels, names = rank_nodes(report), node_names(report)
    nodes = {node["label"]: node for node in report["nodes"]}
    on = {label: {a["network"]: a for a in node["networks"]} for label, node in nodes.items()}
    workers = {a["network"] for node in nodes.values() for a in node["networks"] if a["address"] == node["address"]}
    figures: dict[str, list[dict[str, Any]]] = {}
    for figure in report["networks"]:
        figures.setdefault(figure["network"], []).append(figure)
    findings = [finding for network, measured in figures.items()
                if (finding := _partial_network(network, measured, network in workers, labels))]  # fmt: skip
    used = [figure for network in workers for figure in figures.get(network, [])]
    if not used or any(figure["bandwidth_bytes_per_s"] is None for figure in used):
        return findings
    slowest = min(used, key=lambda figure: figure["bandwidth_bytes_per_s"])
    # What the process group itself measured (links): with NCCL over InfiniBand or RoCE it is far
    # above TCP on the socket interface, and another TCP network is then no way to go faster.
    group = [link["bandwidth_bytes_per_s"] for link in report["links"] if link["bandwidth_bytes_per_s"] is not None]
    bar = FASTER_NETWORK_RATIO * max(slowest["bandwidth_bytes_per_s"], min(group, default=0.0))
    for network, measured in figures.items():
        everywhere = all(network in networks for networks in on.values())
        rates = [figure["bandwidth_bytes_per_s"] for figure in measured]
        if network in workers or not everywhere or None in rates or len(measured) < len(used) or min(rates) < bar:
            continue
        other = min(measured, key=lambda figure: figure["bandwidth_bytes_per_s"])
        interfaces = {label: on[label][network]["interface"] for label in nodes}
        if len(set(interfaces.values())) == 1:
            flag = f"start every node with --interface {next(iter(interfaces.values()))}"
        else:
            flag = "start each node with its interface on it: " + ", ".join(
                f"--interface {interface} on {names[label]}" for label, interface in interfaces.items()
            )
        findings.append(Finding(
            "warning", "faster-network",
            f"the workers talk over {slowest['network']} ({slowest['source_interface']}), measured at {_gbit(slowest)} "
            f"({labels[slowest['source']]} -> {labels[slowest['target']]}); {network} "
            f"({other['source_interface']}) connects every node too and measures {_gbit(other)}",
            f"{flag} (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME follow it), or give --rdzv-endpoint an address on "
            f"{network}: the workers use the network that routes to the endpoint",
        ))  # fmt: skip
    return findings


def _partial_network(
    network: str, measured: list[dict[str, Any]], is_workers: bool, labels: dict[int, str]
) -> Finding | None:
    """A warning when some pairs could not use ``network`` while others could, or the workers'
    network failed a pair: a network no pair reaches (a firewalled management network) is normal."""
    failed = [figure for figure in measured if figure["error"] is not None]
    if not failed or (len(failed) == len(measured) and not is_workers):
        return None
    shown = "; ".join(f"{labels[f['source']]} -> {labels[f['target']]}: {f['error']}" for f in failed[:3])
    stalled = [figure for figure in failed if figure["error"].startswith("connected")]
    hint = ("connections open but transfers stall: look for an MTU mismatch (ping -M do -s 8972 for jumbo frames) or "
            "packet loss on that network" if stalled else
            "a job on that network (--interface) would be refused before its workers start: check the firewall and "
            "routes between those hosts on it")  # fmt: skip
    whose = " (the workers' network)" if is_workers else ""
    more = "; ..." if len(failed) > 3 else ""
    return Finding(
        "warning", "network-unreachable",
        f"{network}{whose}: {len(failed)} of {len(measured)} pairs of nodes could not use it: {shown}{more}",
        hint,
    )  # fmt: skip


def straggler_findings(report: dict[str, Any]) -> list[Finding]:
    speeds = {c["rank"]: c["gflops"] for c in report["compute"]}
    if len(speeds) < 2:
        return []
    median = statistics.median(speeds.values())
    labels = rank_nodes(report)
    return [
        Finding(
            "warning",
            "straggler",
            f"rank {rank} on {labels[rank]} computes {speed:.1f} GFLOP/s, {speed / median:.1%} of the median "
            f"{median:.1f} (a straggler is below {STRAGGLER_RATIO:.0%})",
            "every step waits for the slowest rank: look for other jobs, CPU frequency limits or a "
            "throttled GPU on that node (nvidia-smi -q -d PERFORMANCE)",
        )
        for rank, speed in sorted(speeds.items())
        if speed < STRAGGLER_RATIO * median
    ]


def allreduce_findings(report: dict[str, Any]) -> list[Finding]:
    wrong = report["allreduce"]["wrong"]
    if not wrong:
        return []
    return [Finding("problem", "allreduce-wrong", f"the all-reduce check found {wrong} wrong elements",
                    "the backend returns wrong results: run phalanx bench collectives -c 5 to narrow it down, "
                    "and check the NCCL/driver versions and NCCL_PROTO / NCCL_ALGO settings")]  # fmt: skip


def machine_findings(report: dict[str, Any]) -> list[Finding]:
    """The env report's known traps, once per trap: naming the nodes that have it, or all."""
    names = node_names(report)
    one_host = report["simulated"] or len(report["nodes"]) == 1
    holders: dict[tuple[str, str, str], list[str]] = {}
    for node in report["nodes"]:
        for trap in node["traps"]:
            if one_host and trap.get("between_machines"):
                continue  # it hurts only between machines
            holders.setdefault((trap["topic"], trap["what"], trap["hint"]), []).append(names[node["label"]])
    every = len(report["nodes"])
    return [
        Finding("warning", topic, f"{'every node' if len(nodes) == every > 1 else ', '.join(nodes)}: {what}", hint)
        for (topic, what, hint), nodes in holders.items()
    ]


RULES = (fingerprint_findings, hostname_findings, gpu_findings, allreduce_findings, link_findings,
         network_findings, straggler_findings, clock_findings, machine_findings)  # fmt: skip


def verdict(report: dict[str, Any]) -> list[Finding]:
    findings = [finding for rule in RULES for finding in rule(report)]
    return sorted(findings, key=lambda finding: finding.severity != "problem")
