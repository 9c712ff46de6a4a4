"""phalanx's control plane at 8 to 1,024 nodes, against torch's own rendezvous on the same store.

N simulated nodes are threads of this process, each with its own connections to one real libuv
TCPStore (as the store's host serves them), and each runs phalanx's code itself, not a copy:

  lobby   phalanx.launch.lobby.Lobby.join: a place, the fingerprint compared with the first
          node's, one wait for the word that the nodes met, the two nodes to watch
  reach   phalanx.launch.reachability.Reachability.check: every node listens, connects to its two
          ring neighbours' listeners, posts its failures, and reads the one outcome
  table   phalanx.launch.crossnode.NodeBoard: every node posts its row of the rank table, one gathers them
  end     phalanx.launch.crossnode.CrossNode.workers_finished: every node says that its workers
          finished and waits until all did (torch's exit barrier then passes at once)
  beat    phalanx.launch.liveness.Liveness: the operations of one beat, counted over a few beats

Beside it, on a store of its own: torch's c10d rendezvous (DynamicRendezvousHandler, one per
simulated node, as every torchrun agent makes one), timed to the moment every node has its rank.
Two of its costs are relaxed, because one machine runs every node here where a cluster gives each
its own CPU: the names of its events come from the caller's frame, not ``inspect.stack()`` (see
name_events_cheaply), and its keep-alive interval is its join timeout (see
time_torch_rendezvous). ``--torch-as-shipped`` keeps torch's naming and keep-alive.

Reported per N: for torch, the wall and CPU time of its rendezvous and the store operations of
its busiest node; for phalanx, the store operations of the node that made the most, per phase;
each phase's wall time, and the CPU time of the start's phases (where the two are near, the wall
time is the simulation's CPU: each node's share of it is what a node spends on its own machine);
the steady load of the beats as a share of what the store served in a tight loop here. Workers
are not started: they are torch's, and the harness measures what phalanx adds.

Targets (at the largest N): phalanx's start (lobby, reach and table) adds at most 1 s to torch's
rendezvous, and the beats load the store with less than 1% of what it can serve.

Usage: python benchmarks/control_plane.py [--nodes 8 64 256 1024] [--smoke] [--torch-limit SECONDS]
       [--torch-as-shipped] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from targets import Target, write_report  # benchmarks/: a script's folder is on its path

from phalanx.launch import lobby, name_lookup
from phalanx.launch.crossnode import CrossNode, NodeBoard
from phalanx.launch.liveness import WATCHED, Liveness, beat_of
from phalanx.launch.lobby import Lobby, Meeting, store_client
from phalanx.launch.node_setup import NodeSetup
from phalanx.launch.reachability import Reachability
from phalanx.settings.values import DEFAULT_HEARTBEAT_TIMEOUT_S

REPO = Path(__file__).resolve().parents[1]
#: What the start may add to torch's rendezvous, in seconds, and the beats' share of the store.
ADDED_S_LIMIT = 1.0
LOAD_LIMIT = 0.01
#: torch's rendezvous here, in seconds: its join timeout, its keep-alive interval (unless as
#: shipped) and its store clients' timeout.
JOIN_S = 1800
FINGERPRINT = {"nnodes": "N", "nproc-per-node": "8", "backend": "nccl", "script": "train.py",
               "script sha256": "0" * 64, "phalanx": "0.1.0", "torch": "2.13.0"}  # fmt: skip


class Counted:
    """A store client that counts its operations in ``counts[phase]``."""

    def __init__(self, store: Any, counts: dict[str, int], phase: str = "lobby") -> None:
        self.store, self.counts, self.phase = store, counts, phase

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self.store, name)
        if not callable(operation):
            return operation

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[self.phase] = self.counts.get(self.phase, 0) + 1
            return operation(*args, **kwargs)

        return counted


def setup_of(index: int, nodes: int, port: int) -> NodeSetup:
    return NodeSetup(
        script="train.py", script_args=(), is_module=False, nnodes_min=nodes, nnodes_max=nodes,
        rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="scale", max_restarts=0, heal=0, join_timeout=900.0, last_call=1.0, heartbeat_timeout=30.0,
        nproc_per_node=8, backend="nccl", is_host=False, local_addr="127.0.0.1", interface="lo",
        node_label=f"node{index}", run_dir="unused", all_ranks=False,
    )  # fmt: skip


def in_threads(count: int, work: Callable[[int], Any], name: str) -> tuple[list[Any], float]:
    """Runs ``work(i)`` for every i at once; returns the results (or errors) and the wall time."""
    results: list[Any] = [None] * count
    start = threading.Barrier(count + 1)

    def run(index: int) -> None:
        start.wait()
        try:
            results[index] = work(index)
        except Exception as error:
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.monotonic()
    for thread in threads:
        thread.join()
    failed = [result for result in results if isinstance(result, Exception)]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} of {count} nodes failed, the first with {failed[0]!r}")
    return results, time.monotonic() - began


def master(port: int = 0) -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, multi_tenant=True, use_libuv=True,
                    timeout=timedelta(seconds=900))  # fmt: skip


def phalanx_phases(nodes: int) -> dict[str, Any]:
    lobby.PROGRESS_EVERY_S = 1e9  # a progress line reads the count (and up to 8 names): not the protocol's
    server = master()
    counts: list[dict[str, int]] = [{} for _ in range(nodes)]
    clients: list[Counted | None] = [None] * nodes
    cpu_s: dict[str, float] = {}

    def phase(count: int, work: Callable[[int], Any], name: str) -> tuple[list[Any], float]:
        """in_threads, and this process's CPU time during it (every node's and the store's)."""
        before = time.process_time()
        outcome = in_threads(count, work, name)
        cpu_s[name] = time.process_time() - before
        return outcome

    def join(index: int) -> Meeting:
        def connect(host: str, port: int, timeout_s: float) -> Counted:
            client = Counted(store_client(host, port, timeout_s), counts[index])
            clients[index] = clients[index] or client  # the lobby's main connection: the later phases' too
            return client

        return Lobby(setup_of(index, nodes, server.port), FINGERPRINT, connect=connect).join(watch=WATCHED)

    meetings, lobby_s = phase(nodes, join, "lobby")
    order = {meeting.index: index for index, meeting in enumerate(meetings)}
    for client in clients:
        client.phase = "reach"

    def reach(index: int) -> None:
        setup = setup_of(index, nodes, server.port)
        Reachability(clients[index], "phalanx/scale/", meetings[index].index, nodes, setup.node_label,
                     setup.interface).check()  # fmt: skip

    _, reach_s = phase(nodes, reach, "reach")
    for client in clients:
        client.phase = "table"

    def table(index: int) -> None:
        board = NodeBoard(clients[index], "phalanx/scale/round/0/", "rank_table")
        board.post(index, {"node": index, "label": f"node{index}", "ranks": list(range(8 * index, 8 * index + 8))})
        if index == order[0]:  # the node of rank 0 prints the table
            assert board.gather(nodes) is not None

    _, table_s = phase(nodes, table, "table")
    for client in clients:
        client.phase = "end"

    def end(index: int) -> None:
        crossnode = CrossNode(clients[index], "phalanx/scale/", f"node{index}")
        crossnode.enter_round("0")
        assert crossnode.workers_finished(600.0, lambda: 0, nodes, is_host=False)

    _, end_s = phase(nodes, end, "end")
    phases = ("lobby", "reach", "table", "end")
    return {
        "lobby_s": lobby_s, "reach_s": reach_s, "table_s": table_s, "end_s": end_s,
        "ops_max": {phase: max(c.get(phase, 0) for c in counts) for phase in phases},
        "ops_median": {phase: statistics.median(c.get(phase, 0) for c in counts) for phase in phases},
        "table_gatherer_ops": counts[order[0]].get("table", 0),
        "start_cpu_s": cpu_s["lobby"] + cpu_s["reach"] + cpu_s["table"],
    }  # fmt: skip


def beat_ops(beats: int = 3, beat_s: float = 0.5) -> float:
    """The store operations of one node's beat (a job of 8 nodes here: the count does not depend
    on it, tests/unit/test_liveness.py checks that at 8 and 64)."""
    server = master()
    labels = [f"node{i}" for i in range(8)]
    counts = dict.fromkeys(labels, 0)
    watches = []
    for index, me in enumerate(labels):
        crossnode = CrossNode(server, "phalanx/beat/", me)

        def connect(host: str, port: int, timeout_s: float, me: str = me) -> Any:
            client = Counted(store_client(host, port, timeout_s), {})
            client.counts = counts  # one dict of every node: the phase is the node's label
            client.phase = me
            return client

        watched = [labels[(index + step) % len(labels)] for step in range(1, WATCHED + 1)]
        watches.append(Liveness("127.0.0.1", server.port, "phalanx/beat/", me, watched, ended=crossnode.ended_nodes,
                                on_lost=lambda *_: None, verdicts=crossnode.lost_verdicts, beat_s=beat_s,
                                lost_after_s=600.0, connect=connect))  # fmt: skip
    for watch in watches:
        watch.start()
    time.sleep(beats * beat_s + beat_s / 2)
    done = {me: server.add(f"phalanx/beat/alive/{me}", 0) for me in labels}
    for watch in watches:
        watch.stop()
    return max(counts[me] / max(1, done[me]) for me in labels)


def store_capacity(seconds: float = 2.0, clients: int = 4) -> float:
    """Operations a second this store served to ``clients`` threads in a tight loop of adds."""
    server = master()
    done = [0] * clients
    stop = time.monotonic() + seconds

    def hammer(index: int) -> None:
        client = store_client("127.0.0.1", server.port, 60.0)
        while time.monotonic() < stop:
            client.add("capacity", 1)
            done[index] += 1

    in_threads(clients, hammer, "capacity")
    return sum(done) / seconds


def torch_rendezvous(nodes: int, limit_s: float, as_shipped: bool) -> tuple[float, float, int] | None:
    """Wall and CPU seconds until every one of ``nodes`` DynamicRendezvousHandlers has its rank, and
    the most store operations a node made, in a process of its own (killed after ``limit_s``: None
    then), so that its threads load no other phase."""
    argv = [sys.executable, __file__, "--torch-rendezvous", str(nodes), *(["--torch-as-shipped"] if as_shipped else [])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s, check=True)
    except subprocess.TimeoutExpired:
        return None
    wall, cpu, ops = done.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu), int(ops)


def name_events_cheaply() -> bool:
    """Names torch's rendezvous events from the caller's frame instead of ``inspect.stack()``;
    False where this torch has no such helper (then nothing changed).

    torch's handler names each event by the method that recorded it, and takes the name from
    ``inspect.stack()``, twice: that reads the source file of every frame on the stack. It builds
    the name even when no event handler is set, which is the default. On a cluster each node pays
    that on its own CPU. Here every node shares this machine's, and the compare-and-set retries of
    N nodes record O(N) events each, so at 256 nodes nearly every thread sat in ``inspect`` and
    the rendezvous took more than 600 s. The name is the same; the rendezvous's protocol and store
    operations are untouched. ``--torch-as-shipped`` measures without this.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:  # the frame ``inspect.stack()[depth]`` names
        try:
            frame = sys._getframe(depth)  # 0: this function, 1: the event's recorder, 2: its caller
        except ValueError:
            return "no_method_name"
        return frame.f_code.co_name

    if not hasattr(dynamic_rendezvous, "get_method_name"):  # (torch 2.13 has it)
        return False
    dynamic_rendezvous.get_method_name = get_method_name
    return True


def time_torch_rendezvous(nodes: int, as_shipped: bool) -> tuple[float, float, int]:
    """The measurement itself (``--torch-rendezvous N``): its wall time, this process's CPU time in
    it (every node's and the store's), and the store operations of the node that made the most
    until then: the reads and compare-and-sets of the rendezvous state (not the two reads of the
    master's address that follow, through the handler's own client)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    # torch's keep-alive (5 s in 2.13) counts a node dead after three missed. Here a node's turn at
    # the store waits behind every other node's Python on this machine's cores: from 384 nodes on,
    # nodes were dropped and joined again without end. As shipped it keeps torch's default.
    keep_alive = {} if as_shipped else {"keep_alive_interval": JOIN_S}
    if not as_shipped:
        name_events_cheaply()  # (main() says where it cannot)
    server = master()
    timeout = RendezvousTimeout(join=timedelta(seconds=JOIN_S), last_call=timedelta(seconds=1))
    counts: list[dict[str, int]] = [{} for _ in range(nodes)]

    def rendezvous(index: int) -> tuple[int, Any]:
        client = store_client("127.0.0.1", server.port, float(JOIN_S))
        backend = C10dRendezvousBackend(Counted(client, counts[index], "torch"), "scale")  # type: ignore[arg-type]
        handler = DynamicRendezvousHandler.from_backend("scale", client, backend, nodes, nodes, "127.0.0.1",
                                                        timeout=timeout, **keep_alive)  # fmt: skip
        return handler.next_rendezvous().rank, handler

    cpu = time.process_time()
    done, seconds = in_threads(nodes, rendezvous, "torch-rdzv")
    cpu = time.process_time() - cpu
    ops = max(count["torch"] for count in counts)  # before the shutdown's own
    assert sorted(rank for rank, _ in done) == list(range(nodes)), done
    for _, handler in done:  # once every node has its rank: the first to shut down closes the rendezvous
        handler.shutdown()
    return seconds, cpu, ops


def with_a_resolver_that_answers() -> None:
    """Runs this harness again with a resolv.conf of no name server, whenever it can (root and a
    mount namespace of its own). Each client's connect waits for the lookup of the one before, and
    a machine without a network may answer one lookup at once and time out on the next (5 s a
    lookup; c10d warns "cannot be retrieved. err=-3"): the harness would measure the resolver, not
    the protocols, and a cluster's resolver answers at once. Where it cannot, it goes on, and says
    so when the resolver is slow now."""
    if os.environ.get("PHALANX_HARNESS_RESOLVER"):
        return
    can = os.geteuid() == 0 and shutil.which("unshare") is not None
    if not can or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        if name_lookup.is_slow(name_lookup.lookup_s()):
            print("this machine's resolver does not answer: each store connect waits for it (run as root to avoid it)")
        return
    empty = Path(tempfile.mkdtemp()) / "resolv.conf"
    empty.write_text("# no name server: a lookup fails at once\n")
    script = f'mount --bind {empty} /etc/resolv.conf && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", sys.executable, *sys.argv]
    # c10d warns of every lookup that failed: here, each of thousands of connects
    quiet = {"PHALANX_HARNESS_RESOLVER": "empty", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    os.execvpe("unshare", argv, {**os.environ, **quiet})


def raise_open_files(nodes: int) -> bool:
    """Raises this process's limit of open files to what ``nodes`` need; False when it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 4 * nodes + 256  # each node's connections, and the server's side of them
    if hard != resource.RLIM_INFINITY and needed > hard:
        return False
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    return True


def main() -> None:
    with_a_resolver_that_answers()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--smoke", action="store_true", help="8 and 16 nodes (seconds): proves that the harness runs")
    parser.add_argument(
        "--torch-limit",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="give up on torch's rendezvous of N nodes after this long (default 600)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        metavar="SECONDS",
        help="phalanx run's --heartbeat-timeout, which sets how often nodes beat "
        f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S:g})",
    )
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "control_plane.json")
    parser.add_argument(
        "--torch-as-shipped",
        action="store_true",
        help="time torch's rendezvous with its own event naming (inspect.stack()) and keep-alive, which cost every "
        "node's CPU on this machine's cores",
    )
    parser.add_argument("--torch-rendezvous", type=int, help=argparse.SUPPRESS)  # the child's measurement
    args = parser.parse_args()
    if args.torch_rendezvous:
        raise_open_files(args.torch_rendezvous)
        print(*time_torch_rendezvous(args.torch_rendezvous, args.torch_as_shipped))
        return
    sizes = [8, 16] if args.smoke else args.nodes
    if min(sizes) < 2:
        parser.error(f"--nodes {min(sizes)}: a job of simulated nodes has at least 2")
    for flag, seconds in (("--torch-limit", args.torch_limit), ("--heartbeat-timeout", args.heartbeat_timeout)):
        if not seconds > 0:  # (nan too)
            parser.error(f"{flag} {seconds:g}: a number of seconds, above 0")
    if not args.torch_as_shipped and not name_events_cheaply():  # (the children rename their own)
        print("this torch names its rendezvous events another way: torch's rendezvous is measured as it names them")
    if not raise_open_files(max(sizes)):
        parser.error(f"--nodes {max(sizes)} needs more open files than this machine allows (ulimit -Hn)")

    capacity = store_capacity()
    per_beat, beat_s = beat_ops(), beat_of(args.heartbeat_timeout)
    print(f"store capacity here: {capacity:.0f} operations/s (4 clients, adds); a beat: {per_beat:.1f} operations "
          f"every {beat_s:g} s per node (--heartbeat-timeout {args.heartbeat_timeout:g})")  # fmt: skip
    rows = []
    print(f"{'':>6} {'torch rendezvous':^24} | {'phalanx: start (wall), cpu s, end':^45} | "
          f"{'phalanx: ops per node':^27} |")  # fmt: skip
    header = f"{'nodes':>6} {'wall s':>7} {'cpu s':>7} {'ops':>8} | {'lobby s':>7} {'reach s':>7} {'table s':>7} " \
             f"{'added s':>7} {'cpu s':>6} {'end s':>6} | {'lobby':>6} {'reach':>6} {'table':>6} {'end':>6} | " \
             f"{'beat load':>9}"  # fmt: skip
    print(header)
    for nodes in sizes:
        timed = torch_rendezvous(nodes, args.torch_limit, args.torch_as_shipped)
        torch_s, torch_cpu, torch_ops = timed if timed is not None else (None, None, None)
        ours = phalanx_phases(nodes)
        load = nodes * per_beat / beat_s / capacity
        added = ours["lobby_s"] + ours["reach_s"] + ours["table_s"]
        row = {"nodes": nodes, "torch_rendezvous_s": torch_s, "torch_cpu_s": torch_cpu, "torch_ops_max": torch_ops,
               **ours, "added_s": added, "beat_load": load}  # fmt: skip
        rows.append(row)
        ops = row["ops_max"]
        torch_text = (f"{torch_s:>7.2f} {torch_cpu:>7.2f} {torch_ops:>8}" if timed is not None else
                      f"{'>' + format(args.torch_limit, 'g'):>7} {'-':>7} {'-':>8}")  # fmt: skip
        print(f"{nodes:>6} {torch_text} | {ours['lobby_s']:>7.2f} {ours['reach_s']:>7.2f} {ours['table_s']:>7.2f} "
              f"{added:>7.2f} {ours['start_cpu_s']:>6.2f} {ours['end_s']:>6.2f} | {ops['lobby']:>6} {ops['reach']:>6} "
              f"{ops['table']:>6} {ops['end']:>6} | {load:>9.2%}", flush=True)  # fmt: skip
    print(textwrap.fill(
        f"cpu s: the process's CPU time (every simulated node's and the store's, on {os.cpu_count()} cores): torch's "
        "for its whole rendezvous, phalanx's for the start's phases (lobby, reach, table). Where it comes near the "
        "wall time (or a multiple of it, up to the cores), the wall time is this machine running every node's part, "
        "which on a cluster each node runs on its own. ops: the store operations of the node that made the most.",
        width=110))  # fmt: skip
    largest = rows[-1]
    targets = [
        Target(f"seconds phalanx's start adds to torch's rendezvous ({largest['nodes']} nodes)", largest["added_s"],
               ADDED_S_LIMIT, at_least=False, unit="s"),
        Target(f"the beats' share of the store ({largest['nodes']} nodes)", 100 * largest["beat_load"],
               100 * LOAD_LIMIT, at_least=False, unit="%"),
    ]  # fmt: skip
    results = {"capacity_ops_s": capacity, "beat_ops": per_beat, "heartbeat_timeout_s": args.heartbeat_timeout,
               "torch_limit_s": args.torch_limit, "torch_as_shipped": args.torch_as_shipped, "rows": rows}  # fmt: skip
    write_report(args.json, results, targets,
                 smoke=args.smoke)  # fmt: skip
    print(f"report: {args.json}")


if __name__ == "__main__":
    main()
