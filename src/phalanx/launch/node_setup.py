"""NodeSetup: what one node agent runs, with every decision already made (plain data, JSON
round-trips, so a simulated node's process gets exactly the setup the parent printed)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from phalanx import __version__
from phalanx.errors import SettingsRefused
from phalanx.launch import gpus, name_lookup, network
from phalanx.launch.spec import LaunchSpec
from phalanx.settings.values import SIMULATED_ADDRESS_BASE, Endpoint, NodeRange
from phalanx.torch_compat import installed_torch, outside_range
from phalanx.worker_env import WorkerEnv, job_name


@dataclass(frozen=True)
class NodeSetup:
    """Everything one node agent needs to run its node, decided before it starts: what the decision
    block and the torchrun command are made of."""

    # -- what runs
    #: The training script's path, or the module's name with ``is_module``.
    script: str
    #: The script's arguments, passed untouched.
    script_args: tuple[str, ...]
    #: Whether ``script`` is a module (``-m``).
    is_module: bool
    # -- the job, identical on every node
    #: The fewest and the most nodes (equal but for an elastic job).
    nnodes_min: int
    nnodes_max: int
    #: ``host:port`` as the nodes dial it: where the rendezvous store listens.
    rdzv_endpoint: str
    #: The job's name, the same on every node.
    rdzv_id: str
    #: Restarts of the workers after a failure that a restart can mend.
    max_restarts: int
    #: Replacements of a failed worker per rank while the others keep running (:mod:`.supervisor`).
    heal: int
    #: Seconds the nodes wait for each other, in the lobby and in torchrun's rendezvous.
    join_timeout: float
    #: Elastic jobs: a round's wait for more nodes once the minimum joined.
    last_call: float
    #: Seconds without a sign of life after which a node counts as lost (:mod:`.liveness`).
    heartbeat_timeout: float
    # -- this node
    #: Worker processes on this node.
    nproc_per_node: int
    #: gloo or nccl.
    backend: str
    #: Whether this node hosts the rendezvous store.
    is_host: bool
    #: The address this node advertises to the others.
    local_addr: str
    #: The network interface the workers talk over (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME).
    interface: str
    #: How messages name this node: its address, or ``nodeK`` when simulated.
    node_label: str
    #: This run's log folder (``<log dir>/<time>-<rdzv id>``).
    run_dir: str
    #: Show every rank's output on the console, not only rank 0's.
    all_ranks: bool
    #: K for simulated node K; None for a real node.
    simulated_index: int | None = None
    #: Variables set for the agent and its workers, on top of the inherited environment.
    env: dict[str, str] = field(default_factory=dict)
    #: One line each: what phalanx decided and why (the decision block).
    notes: tuple[str, ...] = ()
    #: More settings the nodes compare before the first step (LaunchSpec.extra_fingerprint).
    extra_fingerprint: dict[str, str] = field(default_factory=dict)
    #: The ranks are meant to work alone: no check that they communicated (--independent-ranks).
    independent_ranks: bool = False
    #: The one address the store listens on, where this node hosts it; None: every address.
    store_address: str | None = None

    @property
    def is_simulated(self) -> bool:
        return self.simulated_index is not None

    @property
    def nnodes(self) -> NodeRange:
        """``--nnodes`` as set: ``nnodes.is_elastic``, and ``str(nnodes)`` as the user writes it."""
        return NodeRange(self.nnodes_min, self.nnodes_max)

    @property
    def command_name(self) -> str:
        """The phalanx command that started this node, as messages to the user name it."""
        if self.is_module and self.script.startswith("phalanx.diagnostics.doctor"):
            return "phalanx doctor"
        if self.is_module and self.script.startswith("phalanx.bench."):
            return "phalanx bench"
        return "phalanx run"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> NodeSetup:
        data = json.loads(text)
        for name in ("script_args", "notes"):
            data[name] = tuple(data[name])
        return cls(**data)


@dataclass(frozen=True)
class _Resources:
    nproc: int
    backend: str
    gpu_count: int
    notes: tuple[str, ...]  # the decision block's lines: the backend, and a warning if any


def usable_cpus() -> int:
    """The CPU cores this process may run on (its affinity: SLURM's or a container's limit), not
    every core of the machine."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: CPU workers per core above which the decision block warns (the 2-core test machine runs 4).
CPU_OVERSUBSCRIPTION = 4


def _resources(spec: LaunchSpec, nodes_on_host: int) -> _Resources:
    gpu_count = gpus.visible_gpu_count()
    wanted = spec.nproc_per_node
    cpu_count = usable_cpus()
    if wanted == "gpu" and gpu_count == 0:
        raise SettingsRefused(
            "--nproc-per-node gpu, but this host has no GPU that CUDA can see",
            "nvidia-smi lists the GPUs; CUDA_VISIBLE_DEVICES may hide them.",
            "use --nproc-per-node N (or auto) to run CPU workers with gloo",
        )
    if isinstance(wanted, int):
        nproc = wanted
    elif wanted == "cpu" or (wanted == "auto" and gpu_count == 0):
        nproc = cpu_count
    else:  # auto or gpu, with GPUs: simulated nodes share this host's GPUs between them
        nproc = max(1, gpu_count // nodes_on_host)
    uses_gpus = gpu_count > 0 and wanted != "cpu"
    backend = spec.backend if spec.backend != "auto" else ("nccl" if uses_gpus else "gloo")
    if backend == "nccl":
        needed = nproc * nodes_on_host
        if gpu_count == 0:
            raise SettingsRefused(
                "--backend nccl, but this host has no GPU that CUDA can see",
                "NCCL only runs between GPUs.",
                "use --backend gloo (or auto) to train on CPUs",
            )
        if needed > gpu_count:
            per_host = f"{nodes_on_host} simulated nodes x {nproc}" if nodes_on_host > 1 else f"{nproc}"
            raise SettingsRefused(
                f"--nproc-per-node {wanted} with --backend nccl needs {needed} GPUs ({per_host}), "
                f"but this host has {gpu_count}",
                "NCCL gives each process a GPU of its own; two processes cannot share one.",
                f"use --nproc-per-node {max(1, gpu_count // nodes_on_host)}, or --backend gloo",
            )
    source = f"{wanted}" if isinstance(wanted, int) else f"{wanted}: {nproc}"
    gpu_text = f"{gpu_count} GPU{'s' if gpu_count != 1 else ''}" if gpu_count else "no GPU"
    notes = [
        f"backend    {backend} ({spec.backend}; {gpu_text}), {source} process{'es' if nproc != 1 else ''} per node"
    ]
    on_host = nproc * nodes_on_host
    if backend == "gloo" and on_host > CPU_OVERSUBSCRIPTION * cpu_count:
        notes.append(
            f"warning    {on_host} worker processes on this host's {cpu_count} CPU cores: each gets a sliver of "
            "a core and the memory of a Python with torch; --nproc-per-node cpu runs one per core"
        )
    return _Resources(nproc, backend, gpu_count, tuple(notes))


def _faster_network_note(chosen: str) -> list[str]:
    """A line when this host has a faster network than the one that routes to the endpoint: on
    hosts with a management and a data network the endpoint is often on the slow one."""
    interfaces = network.local_interfaces()
    faster = network.faster_interface(chosen, interfaces)
    if faster is None:
        return []
    return [
        f"network    {faster.name} ({network.speed_text(faster.speed_mbps)}) is faster than {chosen} "
        f"({network.speed_text(interfaces[chosen].speed_mbps)}), which routes to the endpoint",
        f"           HINT: where every node has that network, start every node with --interface {faster.name}: the "
        "workers' sockets then use it (a check before they start proves that the nodes reach each other there)",
    ]


def _name_lookup_note(address: str) -> list[str]:
    """The decision block's warning when this host's name server makes every store connect wait
    (the store's clients here connect from ``address``)."""
    seconds = name_lookup.lookup_s(address)
    if not name_lookup.is_slow(seconds):
        return []
    return [
        f"warning    {name_lookup.slow_text(seconds, address)}; torch's store client waits for that lookup in "
        "every process of the job",
        f"           HINT: {name_lookup.hint(address)}",
    ]


#: torch's switch for a fresh worker store per restart (read by its c10d rendezvous handler).
FRESH_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _common_env(spec: LaunchSpec, interface: str, resources: _Resources) -> tuple[dict[str, str], list[str]]:
    """The environment every node of this host gets, and one note line per decision."""
    env: dict[str, str] = {}
    kept = []
    for name in network.INTERFACE_VARIABLES:
        if os.environ.get(name):
            kept.append(f"{name}={os.environ[name]}")
        else:
            env[name] = interface
    if kept:
        notes = [f"interface  {interface}; kept {', '.join(kept)} from the environment"]
    else:
        notes = [f"interface  {interface} (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)"]
    notes += resources.notes
    if resources.nproc > 1 and "OMP_NUM_THREADS" not in os.environ:  # as torchrun would, without its banner
        env["OMP_NUM_THREADS"] = "1"
        notes.append("threads    OMP_NUM_THREADS=1 per worker (set it to override)")
    # With the store torchrun shares between agent and workers (its default since 2.4), restarted
    # workers find the previous attempt's keys and fail or hang in init_process_group.
    if spec.max_restarts and FRESH_STORE_VARIABLE not in os.environ:
        env[FRESH_STORE_VARIABLE] = "1"
        notes.append(f"restarts   up to {spec.max_restarts}, each with a fresh worker store ({FRESH_STORE_VARIABLE}=1)")
    return env, notes


def new_run_dir(spec: LaunchSpec) -> Path:
    """This launch's folder under --log-dir, made here (a dry run: only named): ``-2``, ``-3``...
    follow the name where another launch made it first (a sweep started in the same second).
    :func:`phalanx.launch.job.run_nodes` removes it again, with the parents made for it, where the
    launch is refused before it starts."""
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{spec.rdzv_id}"
    if spec.dry_run:
        return spec.log_dir / name
    for suffix in ("", *(f"-{n}" for n in range(2, 1000))):
        folder = spec.log_dir / f"{name}{suffix}"
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
        except OSError:  # --log-dir cannot hold it: refused with the reason once checked (check_log_dir)
            return folder
    return spec.log_dir / name


def set_up_nodes(spec: LaunchSpec, run_dir: Path | None = None) -> list[NodeSetup]:
    """The setups of the node agents this host runs."""
    run_dir = run_dir or new_run_dir(spec)
    if spec.simulate_nodes:
        return _set_up_simulated(spec, run_dir)
    return [_set_up_real(spec, run_dir)]


def _check_interface(spec: LaunchSpec) -> None:
    """Refuses an --interface this host lacks (simulated nodes name it to gloo and NCCL too)."""
    if spec.interface:
        with spec.blamed("interface"):
            network.check_interface(spec.interface)


def _set_up_real(spec: LaunchSpec, run_dir: Path) -> NodeSetup:
    _check_interface(spec)
    resources = _resources(spec, nodes_on_host=1)
    if spec.rdzv_endpoint is None:
        # One node, nobody else to meet: loopback and a port the store picks itself (never 29500).
        endpoint = Endpoint("127.0.0.1", 0)
        choice = network.NetworkChoice(
            endpoint, "127.0.0.1", True, "127.0.0.1", spec.interface or "lo", "single node", store_address="127.0.0.1"
        )
        lines = ["store      on this host, a free port on 127.0.0.1 only (single node)"]
    else:
        placement = spec.placement
        choice = network.choose(
            spec.rdzv_endpoint,
            spec.interface,
            multi_node=spec.is_multi_node,
            node_rank=spec.node_rank,
            peers=placement.hosts if placement else (),
            resolve_wait_s=spec.join_timeout if placement and placement.dns_may_lag else 0.0,
            origin=spec.endpoint_origin,
            allow_public=spec.allow_public_endpoint,
        )
        if choice.is_host:
            network.check_port_free(choice.endpoint_ip, choice.endpoint.port, spec.endpoint_text)
        host_text = "this host hosts it" if choice.is_host else f"hosted by {choice.endpoint_ip}"
        lines = [f"store      {choice.endpoint} ({host_text}: {choice.reason})"]
        if choice.is_host:
            lines.append(f"           listening on {choice.store_address} only" if choice.store_address else
                         f"           listening on every address: {choice.endpoint.host!r} is {choice.endpoint_ip} here, "
                         "not an address of this host's that the other nodes dial")  # fmt: skip
        loopback = choice.hostname_loopback
        trap = f", not the hostname {socket.gethostname()!r}: it resolves to {loopback}" if loopback else ""
        lines.append(f"address    advertising {choice.local_addr}{trap}")
        kept = any(os.environ.get(name) for name in network.INTERFACE_VARIABLES)  # they override --interface
        lines += _faster_network_note(choice.interface) if spec.interface is None and not kept else []
    common_env, common_notes = _common_env(spec, choice.interface, resources)
    lines = [*_cluster_lines(spec), *lines, *common_notes, *_name_lookup_note(choice.local_addr)]
    label = _node_label(spec, choice.local_addr)
    job = job_name(spec.rdzv_id, str(spec.rdzv_endpoint)) if spec.rdzv_endpoint is not None else None
    worker_env = WorkerEnv(backend=resources.backend, node=label, address=choice.local_addr, job=job)
    return NodeSetup(
        **_shared_fields(spec, str(choice.endpoint), resources, run_dir),
        is_host=choice.is_host,
        local_addr=choice.local_addr,
        interface=choice.interface,
        node_label=label,
        env={**common_env, **worker_env.to_env()},
        notes=tuple(lines),
        store_address=choice.store_address,
    )


def _set_up_simulated(spec: LaunchSpec, run_dir: Path) -> list[NodeSetup]:
    count = spec.simulate_nodes
    _check_interface(spec)
    resources = _resources(spec, nodes_on_host=count)
    port = spec.rdzv_endpoint.port if spec.rdzv_endpoint else network.free_port()
    if spec.rdzv_endpoint:  # node0 hosts the store on it, before any node can start
        network.check_port_free("127.0.0.1", port, spec.endpoint_text, nodes="(or leave it out: a free one is picked)")
    endpoint = f"127.0.0.1:{port}"
    interface = spec.interface or "lo"
    common_env, common_notes = _common_env(spec, interface, resources)
    lines = [
        *_cluster_lines(spec),
        f"simulate   {_simulated_nodes(count)}",
        f"store      {endpoint} (hosted by node0, listening on 127.0.0.1 only)",
        *common_notes,
        *_name_lookup_note("127.0.0.1"),
    ]
    setups = []
    for index in range(count):
        address = f"127.0.0.{SIMULATED_ADDRESS_BASE + index}"
        env = {**common_env, **WorkerEnv(backend=resources.backend, node=f"node{index}", address=address,
                                          job=job_name(spec.rdzv_id, endpoint)).to_env()}  # fmt: skip
        if resources.backend == "nccl":  # each simulated node gets GPUs of its own, within the user's mask
            mask = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible = mask.split(",") if mask else [str(k) for k in range(resources.gpu_count)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[index * resources.nproc : (index + 1) * resources.nproc])
        setups.append(
            NodeSetup(
                **_shared_fields(spec, endpoint, resources, run_dir),
                is_host=index == 0,
                local_addr=address,
                interface=interface,
                node_label=f"node{index}",
                simulated_index=index,
                env=env,
                notes=tuple(lines),
                store_address="127.0.0.1" if index == 0 else None,
            )
        )
    return setups


def _simulated_nodes(count: int) -> str:
    first = f"127.0.0.{SIMULATED_ADDRESS_BASE}"
    if count == 1:
        return f"1 node agent on this host, address {first}"
    return f"{count} node agents on this host, addresses {first}-{SIMULATED_ADDRESS_BASE + count - 1}"


def _node_label(spec: LaunchSpec, address: str) -> str:
    """How output names this node: its host name where the cluster environment lists the nodes
    (SLURM's n1), else the address it advertises; node0 when it is the only one."""
    if not spec.is_multi_node:
        return "node0"
    placement = spec.placement
    if placement is not None and placement.hosts and placement.node_rank is not None:
        return placement.hosts[placement.node_rank.value]
    return address


def _cluster_lines(spec: LaunchSpec) -> list[str]:
    """The decision block's lines about the cluster environment: which, what it said, what was overridden."""
    return [("cluster    " if i == 0 else "           ") + note for i, note in enumerate(spec.cluster_notes)]


def _shared_fields(spec: LaunchSpec, endpoint: str, resources: _Resources, run_dir: Path) -> dict[str, object]:
    """The fields every node agent of this host shares."""
    nnodes = spec.simulate_nodes or None
    return {
        "script": spec.entrypoint.target,
        "script_args": spec.entrypoint.args,
        "is_module": spec.entrypoint.is_module,
        "nnodes_min": nnodes or spec.nnodes.min,
        "nnodes_max": nnodes or spec.nnodes.max,
        "rdzv_endpoint": endpoint,
        "rdzv_id": spec.rdzv_id,
        "max_restarts": spec.max_restarts,
        "heal": spec.heal,
        "join_timeout": spec.join_timeout,
        "last_call": spec.last_call,
        "heartbeat_timeout": spec.heartbeat_timeout,
        "extra_fingerprint": dict(spec.extra_fingerprint),
        "independent_ranks": spec.independent_ranks,
        "nproc_per_node": resources.nproc,
        "backend": resources.backend,
        "run_dir": str(run_dir),
        "all_ranks": spec.all_ranks,
    }


def decision_block(setups: list[NodeSetup]) -> str:
    """The short block printed once at start: what phalanx decided for this host, and why."""
    setup = setups[0]
    nnodes = str(setup.nnodes)
    if setup.is_simulated:
        head = f"this host runs job '{setup.rdzv_id}' as {len(setups)} simulated node{'s' if len(setups) > 1 else ''}"
    elif setup.nnodes_max == 1:
        head = f"this host runs job '{setup.rdzv_id}' on 1 node"
    else:
        node = setup.local_addr if setup.node_label == setup.local_addr else f"{setup.node_label} ({setup.local_addr})"
        head = f"node {node} joins job '{setup.rdzv_id}' of {nnodes} nodes"
    torch = installed_torch() or "(not installed)"
    head = f"phalanx {__version__} on torch {torch}: {head}"
    untested = outside_range(torch)
    warning = [f"warning    torch {torch} is {untested}: `phalanx env` names what may not work"] if untested else []
    console = (
        "console    every rank's output"
        if setup.all_ranks
        else "console    rank 0's output (--all-ranks: every rank's)"
    )
    lines = [*setup.notes, *warning, f"logs       {setup.run_dir}/ (every rank's)", console]
    return "\n".join([head, *(f"  {line}" for line in lines)])
