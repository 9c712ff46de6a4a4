"""Node plans, and the torchrun command lines they become."""

import dataclasses
from pathlib import Path

import pytest

from phalanx.errors import SettingsRefused
from phalanx.launch import gpus, network, node_setup
from phalanx.launch.node_setup import NodeSetup, set_up_nodes
from phalanx.launch.spec import LaunchSpec
from phalanx.launch.torchrun import command_line, torchrun_argv, torchrun_env
from phalanx.settings.entrypoint import Entrypoint
from phalanx.settings.values import Endpoint
from tests.unit import node_setups


@pytest.fixture
def entry(tmp_path: Path) -> Entrypoint:
    (tmp_path / "train.py").write_text("")
    return Entrypoint(str(tmp_path / "train.py"), ("--epochs", "1"))


@pytest.fixture(autouse=True)
def no_inherited_interface(monkeypatch):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


def test_single_node_uses_loopback_and_a_free_port(entry, tmp_path):
    [node] = set_up_nodes(LaunchSpec(entrypoint=entry, nproc_per_node=2), run_dir=tmp_path / "run")
    argv = torchrun_argv(node)
    assert "--rdzv-endpoint=127.0.0.1:0" in argv  # port 0: the store picks a free one, never 29500
    assert "--rdzv-conf=is_host=1,join_timeout=300" in argv
    assert argv[-3:] == [entry.target, "--epochs", "1"]
    assert node.env["GLOO_SOCKET_IFNAME"] == "lo" and node.env["OMP_NUM_THREADS"] == "1"


def test_the_log_layout_is_named_only_where_torchrun_must_look_it_up(entry, tmp_path):
    """The printed command names it by its entry point; the agent hands torchrun the object, so
    phalanx run works from a source tree too, where no entry point is installed."""
    [node] = set_up_nodes(LaunchSpec(entrypoint=entry, nproc_per_node=2), run_dir=tmp_path / "run")
    assert "--logs-specs=phalanx" in torchrun_argv(node) and "--logs-specs=phalanx" in command_line(node)
    assert not any(arg.startswith("--logs-specs") for arg in torchrun_argv(node, logs_specs_by_name=False))


def test_simulated_nodes_get_distinct_addresses_and_one_host(entry, tmp_path):
    nodes = set_up_nodes(LaunchSpec(entrypoint=entry, simulate_nodes=3, nproc_per_node=2), run_dir=tmp_path)
    assert [n.is_host for n in nodes] == [True, False, False]
    assert [n.local_addr for n in nodes] == ["127.0.0.101", "127.0.0.102", "127.0.0.103"]
    assert len({n.rdzv_endpoint for n in nodes}) == 1
    assert sorted(n.local_addr for n in nodes) == [n.local_addr for n in nodes]  # torchrun orders nodes so
    for node in nodes:
        argv = torchrun_argv(node)
        assert "--nnodes=3" in argv and f"--local-addr={node.local_addr}" in argv
        assert torchrun_env(node)["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == f"[{node.node_label} rank${{rank}}]: "


def test_a_setup_survives_json(entry, tmp_path):
    [node, _] = set_up_nodes(LaunchSpec(entrypoint=entry, simulate_nodes=2), run_dir=tmp_path)
    assert NodeSetup.from_json(node.to_json()) == node


def test_user_interface_variables_are_kept(entry, tmp_path, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    [node] = set_up_nodes(LaunchSpec(entrypoint=entry), run_dir=tmp_path)
    assert "GLOO_SOCKET_IFNAME" not in node.env and node.env["NCCL_SOCKET_IFNAME"] == "lo"
    assert any("kept GLOO_SOCKET_IFNAME=eth9" in note for note in node.notes)


def test_missing_interface_is_refused_with_the_list(entry, tmp_path):
    with pytest.raises(SettingsRefused) as refused:
        set_up_nodes(LaunchSpec(entrypoint=entry, interface="nosuch0"), run_dir=tmp_path)
    assert "no network interface of that name" in refused.value.what
    assert "lo (127.0.0.1" in refused.value.why


def test_endpoint_on_this_host_makes_it_the_host(entry, tmp_path):
    spec = LaunchSpec(entrypoint=entry, rdzv_endpoint=Endpoint("127.0.0.1", 29400))
    [node] = set_up_nodes(spec, run_dir=tmp_path)
    assert node.is_host and node.local_addr == "127.0.0.1" and node.interface == "lo"


# GPU counts are mocked below: this machine has no GPU, and only the count matters to the check.
def test_nccl_with_more_processes_than_gpus(entry, tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 2)
    with pytest.raises(SettingsRefused) as refused:
        set_up_nodes(LaunchSpec(entrypoint=entry, nproc_per_node=4, backend="nccl"), run_dir=tmp_path)
    assert "needs 4 GPUs" in refused.value.what and "has 2" in refused.value.what
    assert "--nproc-per-node 2" in refused.value.hint


def test_nccl_without_gpus(entry, tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 0)
    with pytest.raises(SettingsRefused, match="no GPU"):
        set_up_nodes(LaunchSpec(entrypoint=entry, backend="nccl"), run_dir=tmp_path)


def test_auto_picks_nccl_and_gpu_count_with_gpus(entry, tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 4)
    [node] = set_up_nodes(LaunchSpec(entrypoint=entry, nproc_per_node="auto"), run_dir=tmp_path)
    assert (node.backend, node.nproc_per_node) == ("nccl", 4)
    simulated = set_up_nodes(LaunchSpec(entrypoint=entry, nproc_per_node="gpu", simulate_nodes=2), run_dir=tmp_path)
    assert [n.nproc_per_node for n in simulated] == [2, 2]  # the host's GPUs are shared out


def test_auto_without_gpus_is_gloo_on_every_core(entry, tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 0)
    monkeypatch.setattr(node_setup, "usable_cpus", lambda: 6)
    [node] = set_up_nodes(LaunchSpec(entrypoint=entry, nproc_per_node="auto"), run_dir=tmp_path)
    assert (node.backend, node.nproc_per_node) == ("gloo", 6)


def test_simulated_nccl_nodes_get_their_own_gpus(entry, tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 4)
    nodes = set_up_nodes(LaunchSpec(entrypoint=entry, nproc_per_node=2, simulate_nodes=2), run_dir=tmp_path)
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in nodes] == ["0,1", "2,3"]
    assert all(n.backend == "nccl" for n in nodes)


def test_dry_run_command_line_is_copyable(entry, tmp_path):
    [node] = set_up_nodes(LaunchSpec(entrypoint=entry), run_dir=tmp_path)
    text = command_line(node)
    assert "torchrun --nnodes=1" in text and "GLOO_SOCKET_IFNAME=lo" in text
    assert "'[node0 rank${rank}]: '" in text  # quoted for the shell
    assert node_setup.decision_block([node]).startswith("phalanx ")


def test_an_endpoint_name_that_resolves_to_loopback_is_refused_for_several_nodes():
    # "localhost" stands for a hostname that /etc/hosts maps to 127.0.1.1, as Debian does
    with pytest.raises(SettingsRefused, match="a loopback address"):
        network.choose(Endpoint("localhost", 29400), multi_node=True)
    assert network.choose(Endpoint("localhost", 29400), multi_node=False).is_host


def test_node_0_whose_name_is_loopback_needs_node_1_s_name_and_says_why():
    # node 0's own name ("localhost", as Debian's 127.0.1.1) is loopback: it routes toward node 1
    # to find its address, so an unknown node-1 name is refused for that, not for the endpoint
    with pytest.raises(SettingsRefused) as refused:
        network.choose(Endpoint("localhost", 29400), node_rank=0, peers=("localhost", "nosuch.invalid"))
    assert refused.value.what.startswith("node 1's host name 'nosuch.invalid' (the second of the cluster's nodes)")
    assert "but 'localhost' resolves to 127.0.0.1 here, a loopback address: phalanx finds" in refused.value.why
    assert "--interface" in refused.value.hint and "endpoint" not in refused.value.hint
    with pytest.raises(SettingsRefused, match="node 1's host name") as refused:  # an address given, not a name
        network.choose(Endpoint("192.0.2.77", 29400), node_rank=0, peers=("192.0.2.77", "nosuch.invalid"))
    assert "'192.0.2.77' resolves to 192.0.2.77 here, an address this host does not own" in refused.value.why


def test_join_timeout_reaches_torchrun_in_whole_seconds(entry, tmp_path):
    [node] = set_up_nodes(LaunchSpec(entrypoint=entry, join_timeout=90.5), run_dir=tmp_path)
    assert "--rdzv-conf=is_host=1,join_timeout=91" in torchrun_argv(node)


def test_last_call_reaches_torchrun_for_an_elastic_job_only():
    fixed = node_setups.node(0, 29400, last_call=7.2)
    assert "--rdzv-conf=is_host=1,join_timeout=5" in torchrun_argv(fixed)
    elastic = dataclasses.replace(fixed, nnodes_max=3)
    assert "--rdzv-conf=is_host=1,join_timeout=5,last_call_timeout=8" in torchrun_argv(elastic)
    assert "--nnodes=2:3" in torchrun_argv(elastic)


def test_many_more_cpu_workers_than_cores_are_warned_of(entry, tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 0)
    monkeypatch.setattr(node_setup, "usable_cpus", lambda: 2)
    fine = set_up_nodes(LaunchSpec(entry, nproc_per_node=8), tmp_path)[0]
    crowded = set_up_nodes(LaunchSpec(entry, nproc_per_node=9), tmp_path)[0]
    assert not any(note.startswith("warning") for note in fine.notes)
    assert any(note.startswith("warning    9 worker processes on this host's 2 CPU cores") for note in crowded.notes)


def nics(**speeds: int) -> dict[str, network.Interface]:
    """This host's interfaces as psutil would report them, with link speeds in Mb/s: the machine
    has only virtual ones (speed 0 or veth's fixed 10000), so the speeds are given here."""
    found = {"lo": network.Interface("lo", ("127.0.0.1",), True)}
    for k, (name, speed) in enumerate(speeds.items(), 1):
        found[name] = network.Interface(name, (f"10.{k}.0.1",), True, speed)
    return found


def test_a_faster_network_beside_the_endpoint_s_is_named_with_a_hint(monkeypatch):
    monkeypatch.setattr(network, "local_interfaces", lambda: nics(eth0=1000, ib0=100000, eth1=25000))
    note = node_setup._faster_network_note("eth0")
    assert note[0] == "network    ib0 (100 Gbit/s) is faster than eth0 (1 Gbit/s), which routes to the endpoint", note
    assert "HINT: where every node has that network, start every node with --interface ib0" in note[1], note


@pytest.mark.parametrize("speeds", [
    {"eth0": 100000, "eth1": 1000},  # the endpoint's network is the fastest
    {"eth0": 0, "eth1": 100000},  # the endpoint's speed unknown (a virtual interface): nothing to compare
    {"eth0": 1000, "eth1": 1000},  # as fast
])  # fmt: skip
def test_no_faster_network_no_line(monkeypatch, speeds):
    monkeypatch.setattr(network, "local_interfaces", lambda: nics(**speeds))
    assert node_setup._faster_network_note("eth0") == []


def test_a_faster_interface_that_is_down_has_no_address_or_is_software_is_not_offered():
    interfaces = {**nics(eth0=1000), "ib0": network.Interface("ib0", ("10.9.0.1",), False, 100000),
                  "ib1": network.Interface("ib1", (), True, 100000),
                  "docker0": network.Interface("docker0", ("172.17.0.1",), True, 10000, is_virtual=True)}  # fmt: skip
    assert network.faster_interface("eth0", interfaces) is None


def test_the_decision_block_names_a_faster_network_unless_an_interface_was_given(entry, tmp_path, monkeypatch):
    """The endpoint on this host's own (non-loopback) address: its interface is made 1 Gbit/s, and an
    ib0 of 1,000 Gbit/s is added beside it."""
    own = network.local_interfaces()
    nic = next((i for i in own.values() if i.is_up and not i.is_loopback and i.addresses), None)
    if nic is None:
        pytest.skip("this machine has no non-loopback interface with an address")
    interfaces = {name: dataclasses.replace(i, speed_mbps=1000) if name == nic.name else i for name, i in own.items()}
    interfaces["ib0"] = network.Interface("ib0", ("10.9.0.1",), True, 10**6)
    monkeypatch.setattr(network, "local_interfaces", lambda: interfaces)
    endpoint = Endpoint(nic.addresses[0], node_setups.free_port())
    spec = LaunchSpec(entrypoint=entry, rdzv_endpoint=endpoint, allow_public_endpoint=True)
    [node] = set_up_nodes(spec, run_dir=tmp_path / "run")
    assert node.interface == nic.name
    assert (
        f"network    ib0 (1000 Gbit/s) is faster than {nic.name} (1 Gbit/s), which routes to the endpoint" in node.notes
    )
    given = dataclasses.replace(spec, interface=nic.name)
    [node] = set_up_nodes(given, run_dir=tmp_path / "given")
    assert not any(line.startswith("network ") for line in node.notes), node.notes
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", nic.name)  # kept: it overrides --interface, so no hint to pass one
    [node] = set_up_nodes(spec, run_dir=tmp_path / "kept")
    assert not any(line.startswith("network ") for line in node.notes), node.notes


def test_launches_in_the_same_second_get_folders_of_their_own(entry, tmp_path, monkeypatch):
    monkeypatch.setattr(node_setup.time, "strftime", lambda _: "20261208-010203")  # a sweep's jobs, started at once
    spec = LaunchSpec(entrypoint=entry, log_dir=tmp_path / "logs")
    first, second = node_setup.new_run_dir(spec), node_setup.new_run_dir(spec)
    assert (first.name, second.name) == ("20261208-010203-phalanx", "20261208-010203-phalanx-2")
    assert first.is_dir() and second.is_dir()
    dry = node_setup.new_run_dir(dataclasses.replace(spec, dry_run=True, log_dir=tmp_path / "dry"))
    assert dry.name == "20261208-010203-phalanx" and not (tmp_path / "dry").exists()  # a dry run makes nothing


def test_a_refused_launch_leaves_no_folder_behind(entry, tmp_path):
    from phalanx.launch.job import run_nodes

    logs = tmp_path / "deep" / "logs"
    with pytest.raises(SettingsRefused, match="nosuch9"):
        run_nodes(LaunchSpec(entrypoint=entry, log_dir=logs, interface="nosuch9"))
    assert not (tmp_path / "deep").exists()
