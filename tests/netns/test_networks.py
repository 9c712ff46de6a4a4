"""Hosts with two networks: a job whose workers would talk over a network that some peers cannot
reach ends in a clear refusal, every node alike and within a bound, never in a hang in
``init_process_group``; where every peer reaches every other, the job runs.

Three test-bed hosts with a main network (eth0, the rendezvous endpoint's) and a data network
(eth1). The workers are sent over the data network with --interface eth1; the data network is
then cut between two hosts only (iptables drops their packets to each other), or for one host
(its link goes down), or the hosts' names resolve to the data network and one host is cut off
from it. Stage two: each case starts torch on three hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time

import pytest

from phalanx.testbed import run_together, test_bed
from tests.netns.hosts import skip_unless_namespaces_work

pytestmark = [pytest.mark.netns, pytest.mark.cluster]

ALL_REDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"sum {total.item():g}", flush=True)
dist.destroy_process_group()
"""
#: What a refusal may take: the lobby, one connect's 3 s timeout, the posting; torch's import
#: on three hosts sharing two cores is most of it.
REFUSED_WITHIN_S = 60


@contextlib.contextmanager
def three_hosts(tmp_path, names_on: str = "main"):
    """Three hosts with a data network, and the script in ``tmp_path``."""
    skip_unless_namespaces_work()
    (tmp_path / "all_reduce.py").write_text(ALL_REDUCE)
    with test_bed(f"n{os.getpid() % 10000}", ["h1", "h2", "h3"], data_network=True, names_on=names_on) as made:
        yield made


@pytest.fixture
def bed(tmp_path):
    with three_hosts(tmp_path) as made:
        yield made


def run_job(bed, tmp_path, *options: str, endpoint: str | None = None, timeout: float = 120, nnodes: str = "3"):
    line = [sys.executable, "-m", "phalanx", "run", "--nnodes", nnodes, "--rdzv-endpoint",
            f"{endpoint or bed.hosts[0].address}:29400", *options, str(tmp_path / "all_reduce.py")]  # fmt: skip
    started = time.monotonic()
    outcomes = run_together([host.command(line) for host in bed.hosts], timeout=timeout, cwd=tmp_path)
    return outcomes, time.monotonic() - started


def test_workers_on_a_data_network_every_peer_reaches_run(bed, tmp_path):
    outcomes, _ = run_job(bed, tmp_path, "--interface", "eth1")
    assert [outcome.returncode for outcome in outcomes] == [0, 0, 0], [o.output[-2000:] for o in outcomes]
    assert "sum 3" in outcomes[0].output
    assert "interface  eth1 (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)" in outcomes[0].output


@pytest.mark.parametrize("nnodes", ["3", "3:4"], ids=["fixed", "elastic"])
def test_a_data_network_cut_between_two_hosts_only_is_refused_by_every_node_with_a_table(bed, tmp_path, nnodes):
    """h1 and h2 reach each other on the main network (the lobby meets there) and every host on
    the data network but each other: their packets to each other vanish, so gloo's connect between
    them would wait for the process group's timeout (300 s). A job of a fixed size is refused once
    its nodes met in the lobby; an elastic one (three nodes at least, up to four) once torch's
    rendezvous round gave its three nodes their places."""
    h1, h2, _ = bed.hosts
    bed.cut_between("h1", "h2", "data")
    elastic = ("--last-call", "1") if ":" in nnodes else ()
    outcomes, seconds = run_job(bed, tmp_path, "--interface", "eth1", *elastic, nnodes=nnodes)
    assert [outcome.returncode for outcome in outcomes] == [2, 2, 2], [o.output[-2000:] for o in outcomes]
    assert seconds < REFUSED_WITHIN_S, seconds
    tables = []
    for outcome in outcomes:
        text = outcome.output
        assert "phalanx: error: peers cannot reach " in text and "where their workers will listen" in text, text[-3000:]
        assert "HINT: every node must reach every other on the workers' interface" in text, text[-3000:]
        assert "sum 3" not in text
        rows = [line.split() for line in text.splitlines() if "timed out after 3 s" in line]
        tables.append(sorted(tuple(row[:4]) for row in rows))
    assert all(table == tables[0] for table in tables), tables  # every node prints the same table
    # each of the two was unreachable for the other, on its data address, over eth1
    unreachable = {(row[1], row[2].split(":")[0]) for row in tables[0]}
    assert unreachable == {("eth1", h1.data_address), ("eth1", h2.data_address)}, tables[0]
    print(
        f"MEASURED: a data network cut between two of three hosts ({nnodes} nodes): every node refused "
        f"{seconds:.1f} s after the start"
    )


def test_a_host_whose_data_link_is_down_is_refused_and_the_others_give_up_within_the_join_timeout(bed, tmp_path):
    bed.cut_link("h3", "data")
    outcomes, seconds = run_job(bed, tmp_path, "--interface", "eth1", "--join-timeout", "10")
    codes = [outcome.returncode for outcome in outcomes]
    assert codes == [3, 3, 2], [o.output[-2000:] for o in outcomes]
    assert "--interface eth1 is down" in outcomes[2].output, outcomes[2].output[-2000:]
    assert all("only 2 of 3 nodes joined" in outcome.output for outcome in outcomes[:2]), outcomes[0].output[-2000:]
    assert seconds < REFUSED_WITHIN_S, seconds


def test_host_names_that_resolve_to_a_network_one_host_is_cut_off_from_do_not_lead_the_workers_there(tmp_path):
    """The hosts' names resolve to the data network, which h3 is cut off from. The workers do not
    follow the names: every node pins them to the interface that routes to the endpoint (eth0,
    GLOO_SOCKET_IFNAME), the reachability check passes there, and the job runs."""
    with three_hosts(tmp_path, names_on="data") as named:
        named.cut_link("h3", "data")
        outcomes, _ = run_job(named, tmp_path)
    assert [outcome.returncode for outcome in outcomes] == [0, 0, 0], [o.output[-2000:] for o in outcomes]
    assert "sum 3" in outcomes[0].output
    assert all("interface  eth0 " in outcome.output for outcome in outcomes), outcomes[0].output[-2000:]


def test_doctor_measures_each_network_and_names_the_faster_one_with_its_interface(bed, tmp_path):
    """The endpoint's network (eth0) is shaped to 200 Mbit/s, the data network (eth1) is not: the
    doctor measures both between every pair of hosts, and its verdict names the data network and
    the flag that moves the workers there."""
    from phalanx.testbed import Shaping

    bed.shape(Shaping(rate="200mbit"), network="main")
    doctor = [sys.executable, "-m", "phalanx", "doctor", "--nnodes", "3", "--rdzv-endpoint",
              f"{bed.hosts[0].address}:29400", "--p2p-size", "4M", "--max-bytes", "4M", "--json"]  # fmt: skip
    lines = []
    for host in bed.hosts:  # each in a folder of its own, as on a machine of its own
        (tmp_path / host.name).mkdir()
        lines.append(host.command(["sh", "-c", f"cd {tmp_path / host.name} && {shlex.join(doctor)} > report.json"]))
    outcomes = run_together(lines, timeout=180, cwd=tmp_path)
    # h1 ran rank 0: its exit code is the verdict's, 1 for the one problem test-bed hosts have (the
    # machine's hostname, which they share)
    assert [outcome.returncode for outcome in outcomes] == [1, 0, 0], [o.output[-3000:] for o in outcomes]
    report = json.loads((tmp_path / "h1" / "report.json").read_text())
    assert {f["topic"] for f in report["findings"] if f["severity"] == "problem"} == {"duplicate-hostname"}
    main, data = (f"{'.'.join(address.split('.')[:3])}.0/24" for address in (bed.hosts[0].address,
                                                                               bed.hosts[0].data_address))  # fmt: skip
    measured = {(f["network"], f["source_interface"]): f["bandwidth_bytes_per_s"] for f in report["networks"]}
    assert len(report["networks"]) == 6 and all(f["error"] is None for f in report["networks"]), report["networks"]
    slow = max(rate for (network, _), rate in measured.items() if network == main)
    fast = min(rate for (network, _), rate in measured.items() if network == data)
    assert slow * 8 / 1e6 < 220 and fast > 1.5 * slow, measured  # tbf at 200 Mbit/s; an unshaped veth is far above
    [finding] = [f for f in report["findings"] if f["topic"] == "faster-network"]
    assert f"the workers talk over {main} (eth0)" in finding["what"], finding
    assert f"{data} (eth1) connects every node too" in finding["what"], finding
    assert finding["hint"].startswith("start every node with --interface eth1"), finding
    print(f"MEASURED: doctor on 3 hosts: main network {slow * 8 / 1e6:.0f} Mbit/s, data {fast * 8 / 1e9:.2g} Gbit/s")
