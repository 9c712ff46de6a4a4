"""`phalanx env`: the report on this real machine, the variables it lists, the settings it resolves.

Facts are checked against what the system says by other means (sys, torch, resource, statvfs).
Only what this machine cannot have is faked, and each such test says so: an InfiniBand card and
a link speed (a fake /sys tree under ``root``), and a GPU (a stand-in for torch.cuda).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import resource
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from phalanx.cli.main import build_parser
from phalanx.diagnostics import machine, traps
from phalanx.diagnostics.env_report import collect_env_report, comparable_facts
from phalanx.diagnostics.env_text import render
from phalanx.diagnostics.launch_settings import json_value, resolved_settings
from phalanx.diagnostics.torch_facts import gpu_report, nvidia_driver_version, torch_facts
from phalanx.launch import name_lookup
from phalanx.launch.options import spec_from_args
from phalanx.settings.options import LAUNCH_OPTIONS, read_config_file

HEADERS = ("host", "torch", "gpus", "network interfaces", "infiniband", "resources", "variables", "launch settings")


@pytest.fixture(scope="module")
def report():
    return collect_env_report(environ={})


def test_report_on_this_machine(report):
    assert report.host.hostname == socket.gethostname()
    assert report.host.python == "{}.{}.{}".format(*sys.version_info[:3])
    assert report.torch.version == torch.__version__
    assert report.torch.gloo_available is True
    assert report.torch.cuda_build == torch.version.cuda
    if not torch.cuda.is_available():  # this machine: CPU-only torch, no GPU
        assert report.gpus.devices == () and report.torch.nccl is None
    else:
        assert len(report.gpus.devices) == torch.cuda.device_count()
    loopback = [interface for interface in report.interfaces if "127.0.0.1" in interface.addresses]
    assert len(loopback) == 1 and loopback[0].is_loopback and loopback[0].is_up
    assert all(isinstance(interface.mtu, int) and interface.mtu > 0 for interface in report.interfaces)
    assert not any(interface.is_loopback for interface in report.interfaces if interface not in loopback)
    shm = os.statvfs("/dev/shm")
    assert report.shm.total_bytes == shm.f_blocks * shm.f_frsize
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert (report.limits.open_files_soft, report.limits.open_files_hard) == (soft, hard)
    assert report.variables == {} and report.config_file is None


def test_json_document_round_trips(report):
    document = report.to_json()
    assert json.loads(json.dumps(document)) == document
    assert document["schema"] == 1 and document["torch"]["version"] == torch.__version__
    assert {"hostname", "fqdn", "hostname_addresses", "hostname_is_loopback", "kernel"} <= set(document["host"])
    assert {"name", "is_up", "is_loopback", "addresses", "mtu", "speed_mbps"} == set(document["interfaces"][0])


def test_hostname_trap_matches_what_the_resolver_says(report):
    resolved = socket.gethostbyname(socket.gethostname())
    is_loopback = ipaddress.ip_address(resolved).is_loopback  # 127.0.0.1 on this machine (/etc/hosts)
    assert report.host.hostname_is_loopback == is_loopback
    assert resolved in report.host.hostname_addresses
    topics = [finding.topic for finding in report.findings]
    assert ("hostname-loopback" in topics) == is_loopback


def test_a_name_lookup_that_waits_for_the_name_server_is_a_trap(report):
    """The name server itself is tested in tests/netns/test_name_server.py; here, the rule and its text."""
    slow = dataclasses.replace(report.host, name_lookup_s=2.5, name_lookup_address="10.0.0.2")
    (finding,) = traps.name_lookup_trap(slow)
    assert finding.topic == "name-lookup-slow" and "the name of 10.0.0.2 takes 2.5 s here" in finding.what, finding
    assert "err=-3" in finding.why and "`time getent hosts ::ffff:10.0.0.2`" in finding.hint
    assert traps.name_lookup_trap(dataclasses.replace(slow, name_lookup_s=0.01)) == []
    shown = render(dataclasses.replace(report, host=slow, findings=(finding,)))
    assert "name lookup  2500 ms for the name of 10.0.0.2, as torch's store client asks it (slow: see WARNING" in shown
    assert "WARNING: looking up the name of 10.0.0.2 takes 2.5 s here" in shown
    capped = render(dataclasses.replace(report, host=dataclasses.replace(slow, name_lookup_s=name_lookup.LIMIT_S)))
    assert "name lookup  at least 3000 ms" in capped
    assert report.to_json()["host"]["name_lookup_address"] == report.host.name_lookup_address


def test_variables_filter():
    environ = {
        "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "lo",
        "RANK": "3",
        "MY_UNRELATED": "x",
        "NCCLX": "y",
        "PATH": "/bin",
    }
    assert machine.distributed_variables(environ) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "INFO", "RANK": "3"}


def test_comparable_facts_leave_out_per_rank_variables():
    one = comparable_facts(collect_env_report(environ={"NCCL_DEBUG": "INFO", "RANK": "0", "GLOO_SOCKET_IFNAME": "lo"}))
    two = comparable_facts(collect_env_report(environ={"NCCL_DEBUG": "WARN", "RANK": "1"}))
    assert one["torch"] == two["torch"] == torch.__version__ and one["gpu count"] == str(torch.cuda.device_count())
    assert [key for key in one if one[key] != two.get(key)] == ["env NCCL_DEBUG"]
    assert set(one) == set(two)  # RANK and the per-node interface are not compared


def setting_values(settings):
    return {setting.flag: (setting.value, setting.source) for setting in settings}


def test_settings_precedence_env_over_config_over_default(tmp_path):
    config = tmp_path / "phalanx.toml"
    config.write_text('nproc-per-node = 4\nmax_restarts = 2\nrdzv-endpoint = "10.0.0.1"\n')
    environ = {"PHALANX_NPROC_PER_NODE": "3", "PHALANX_DRY_RUN": "1"}
    values = setting_values(resolved_settings(environ, read_config_file(config), config))
    assert values["nproc-per-node"] == (3, "environment")
    assert values["max-restarts"] == (2, "config")
    assert values["rdzv-endpoint"] == ("10.0.0.1:29400", "config")
    assert values["dry-run"] == (True, "environment")
    assert values["nnodes"] == ("1", "default") and values["join-timeout"] == (300.0, "default")

    # The same sources give phalanx run exactly these values.
    script = tmp_path / "train.py"
    script.write_text("")
    spec = spec_from_args(build_parser().parse_args(["run", "--config", str(config), str(script)]), environ)
    assert {option.flag: json_value(getattr(spec, option.field)) for option in LAUNCH_OPTIONS} == {
        flag: value for flag, (value, _) in values.items()
    }


def test_a_value_run_would_refuse_is_reported_not_raised():
    settings = resolved_settings({"PHALANX_NNODES": "two", "PHALANX_BACKEND": "gloo"}, {}, None)
    nnodes = next(setting for setting in settings if setting.flag == "nnodes")
    assert nnodes.value == "two" and "PHALANX_NNODES" in nnodes.refused and nnodes.hint
    assert setting_values(settings)["backend"] == ("gloo", "environment")


def test_fake_infiniband_tree(tmp_path):
    # This machine has no RDMA device: a fake /sys tree as the mlx5 driver writes it.
    ports = tmp_path / "sys/class/infiniband"
    for device, state, phys in (("mlx5_0", "4: ACTIVE", "5: LinkUp"), ("mlx5_1", "1: DOWN", "3: Disabled")):
        port = ports / device / "ports/1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "phys_state").write_text(phys + "\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (ports / "mlx5_0/ports/1/link_layer").write_text("InfiniBand\n")
    (ports / "mlx5_0/ports/2").mkdir()  # a port whose attributes cannot be read
    found = machine.infiniband_ports(tmp_path)
    assert [(p.device, p.port, p.state, p.phys_state, p.link_layer) for p in found] == [
        ("mlx5_0", 1, "ACTIVE", "LinkUp", "InfiniBand"),
        ("mlx5_0", 2, "unknown", "unknown", "unknown"),
        ("mlx5_1", 1, "DOWN", "Disabled", "unknown"),
    ]
    assert found[0].rate == "200 Gb/sec (4X HDR)" and found[1].rate == "unknown"
    assert machine.infiniband_ports(tmp_path / "nothing") == []
    assert traps.infiniband_trap(found) == []
    assert [f.topic for f in traps.infiniband_trap([found[2]])] == ["infiniband-down"]

    fake = collect_env_report(environ={}, root=tmp_path)
    text = render(fake)
    assert "mlx5_1  1     DOWN" in text and "200 Gb/sec (4X HDR)" in text
    locked_limited = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] != resource.RLIM_INFINITY
    assert ("locked-memory-limited" in [f.topic for f in fake.findings]) == locked_limited
    assert fake.shm.total_bytes is None and "unknown" in text  # no dev/shm under the fake root


def test_link_speed_from_sysfs(tmp_path):
    # The loopback has no link speed (sysfs refuses to say); a fake tree gives it one.
    real = {interface.name: interface for interface in machine.interface_facts()}
    lo = next(name for name, interface in real.items() if interface.is_loopback)
    assert real[lo].speed_mbps is None
    (tmp_path / "sys/class/net" / lo).mkdir(parents=True)
    (tmp_path / "sys/class/net" / lo / "speed").write_text("25000\n")
    faked = {interface.name: interface for interface in machine.interface_facts(tmp_path)}
    assert faked[lo].speed_mbps == 25000 and "25 Gbit/s" in render(collect_env_report(environ={}, root=tmp_path))


def test_gpus_and_driver_with_a_stand_in_for_torch_cuda(tmp_path):
    # No GPU here: a stand-in for torch.cuda with the H200's properties, and the driver's /proc file.
    h200 = SimpleNamespace(name="NVIDIA H200", total_memory=150_110_011_392, major=9, minor=0)
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 2, get_device_properties=lambda index: h200)
    version_file = tmp_path / "proc/driver/nvidia/version"
    version_file.parent.mkdir(parents=True)
    version_file.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  (dvs)\n"
    )
    gpus = gpu_report(cuda, tmp_path)
    assert gpus.driver == "570.124.06"
    assert [(gpu.index, gpu.name, gpu.capability) for gpu in gpus.devices] == [
        (0, "NVIDIA H200", "9.0"),
        (1, "NVIDIA H200", "9.0"),
    ]
    version_file.write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
    )
    assert nvidia_driver_version(tmp_path) == "535.104.05"
    assert nvidia_driver_version(tmp_path / "no-driver") == "none"
    facts = torch_facts()
    cpu_build_on_gpu_machine = [f.topic for f in traps.driver_trap(facts, gpus)]
    assert cpu_build_on_gpu_machine == ([] if facts.cuda_build else ["torch-cpu-build"])


def test_shm_and_open_files_traps():
    assert [f.topic for f in traps.shm_trap(machine.ShmFacts("/dev/shm", 64 * 1024**2, 60 * 1024**2))] == ["shm-small"]
    assert traps.shm_trap(machine.ShmFacts("/dev/shm", 2 * 1024**3, 1024**3)) == []
    assert traps.shm_trap(machine.ShmFacts("/dev/shm", None, None)) == []
    low = traps.limit_traps(machine.LimitFacts(1024, 1048576, None, None), [])
    assert [f.topic for f in low] == ["open-files-low"] and "ulimit -n 1048576" in low[0].hint
    assert "limits.conf" in traps.limit_traps(machine.LimitFacts(1024, 1024, None, None), [])[0].hint
    assert traps.limit_traps(machine.LimitFacts(65536, None, None, None), []) == []


@pytest.mark.parametrize(
    "variable, value, flagged",
    [
        ("GLOO_SOCKET_IFNAME", "nosuch0", True),
        ("GLOO_SOCKET_IFNAME", "LO_NAME", False),
        ("NCCL_SOCKET_IFNAME", "LO_PREFIX", False),  # NCCL takes prefixes
        ("NCCL_SOCKET_IFNAME", "=LO_PREFIX", True),  # "=" asks for the exact name
        ("NCCL_SOCKET_IFNAME", "^docker", False),  # an exclusion names no interface
    ],
)
def test_interface_variable_naming_a_missing_interface(report, variable, value, flagged):
    lo = next(interface.name for interface in report.interfaces if interface.is_loopback)
    value = value.replace("LO_NAME", lo).replace("LO_PREFIX", lo[:-1])
    found = traps.interface_variable_traps({variable: value}, list(report.interfaces))
    assert bool(found) == flagged


def phalanx_env(*args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "env", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_cli_json_lists_set_variables_and_resolved_settings(tmp_path):
    config = tmp_path / "phalanx.toml"
    config.write_text("[run]\nnproc-per-node = 4\nmax-restarts = 2\n")
    result = phalanx_env(
        "--json", "--config", str(config),
        env={"NCCL_DEBUG": "INFO", "PHALANX_NPROC_PER_NODE": "3", "ENV_REPORT_UNRELATED": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["variables"]["NCCL_DEBUG"] == "INFO" and "ENV_REPORT_UNRELATED" not in document["variables"]
    settings = {setting["flag"]: setting for setting in document["settings"]}
    assert (settings["nproc-per-node"]["value"], settings["nproc-per-node"]["origin"]) == (3, "PHALANX_NPROC_PER_NODE")
    assert (settings["max-restarts"]["value"], settings["max-restarts"]["origin"]) == (2, str(config))
    assert document["config_file"] == str(config)


def test_cli_human_report(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("max-restarts = 2\n")
    result = phalanx_env(env={"PHALANX_CONFIG": str(config), "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("phalanx env: ")
    for header in HEADERS:
        assert any(line == header or line.startswith(header + " (") for line in lines), header
    assert any(line.split()[:2] == ["TORCH_DISTRIBUTED_DEBUG", "DETAIL"] for line in lines)
    assert any(line.split() == ["max-restarts", "2", str(config)] for line in lines)
    assert any("127.0.0.1" in line and line.rstrip().endswith("loopback") for line in lines)


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "does not exist"),
        ("nproc-per-node = [", "is not valid TOML"),
        ("nprocs = 2\n", "unknown setting 'nprocs'"),
    ],
)
def test_bad_config_exits_2_with_a_hint(tmp_path, content, says):
    config = tmp_path / "c.toml"
    if content is not None:
        config.write_text(content)
    result = phalanx_env("--config", str(config))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("phalanx: error: ") and says in result.stderr and "\nHINT: " in result.stderr


def test_refused_setting_prints_the_report_then_exits_2():
    result = phalanx_env("--json", env={"PHALANX_NNODES": "two"})
    assert result.returncode == 2
    settings = {setting["flag"]: setting for setting in json.loads(result.stdout)["settings"]}
    assert settings["nnodes"]["value"] == "two" and settings["nnodes"]["refused"]
    assert "PHALANX_NNODES" in result.stderr and "\nHINT: " in result.stderr


def test_the_cluster_environment_run_would_detect_is_reported():
    from tests.unit.test_clusters import SLURM_STEP

    cluster = collect_env_report(environ=SLURM_STEP).to_json()["cluster"]
    assert cluster["name"] == "SLURM" and cluster["description"] == "SLURM job 4242 (step 0) on gpu[07-08]"
    assert cluster["values"]["nnodes"] == "2" and cluster["values"]["hosts"] == "gpu07,gpu08"
    assert "SLURM_NODEID=1" in cluster["sources"]
    assert "environment  SLURM job 4242 (step 0) on gpu[07-08]" in render(collect_env_report(environ=SLURM_STEP))
    none = collect_env_report(environ={}).to_json()["cluster"]
    assert none["name"] is None and none["description"].startswith("none detected")
    refused = collect_env_report(environ={**SLURM_STEP, "SLURM_STEP_NODELIST": "gpu[07"}).to_json()["cluster"]
    assert refused["name"] == "refused" and "does not parse" in refused["refused"] and refused["hint"]


def test_settings_the_cluster_environment_fills_are_shown_as_run_would_use_them(tmp_path):
    # a SLURM step's variables (no controller needed: phalanx reads them only), on this host
    hostname = socket.gethostname()
    environ = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": f"{hostname},{hostname}", "SLURM_NODEID": "0",
               "SLURM_NNODES": "2", "PHALANX_RDZV_ID": "mine"}  # fmt: skip
    values = setting_values(resolved_settings(environ, {}, None))
    assert values["nnodes"] == ("2", "cluster") and values["rdzv-endpoint"] == (f"{hostname}:29642", "cluster")
    assert values["rdzv-id"] == ("mine", "environment") and values["nproc-per-node"] == (1, "default")
    script = tmp_path / "train.py"
    script.write_text("")
    spec = spec_from_args(build_parser().parse_args(["run", str(script)]), environ)
    assert {option.flag: json_value(getattr(spec, option.field)) for option in LAUNCH_OPTIONS} == {
        flag: value for flag, (value, _) in values.items()
    }
