"""``--simulate-nodes K``: K node agents on this host, each a real torchrun agent in a process
of its own on its own loopback address."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from phalanx.console import say
from phalanx.exit_codes import ExitCode
from phalanx.launch import failure
from phalanx.launch.agent import failure_file
from phalanx.launch.node_setup import NodeSetup
from phalanx.launch.signals import PASSED_ON, handling
from phalanx.worker_env import WorkerEnv

#: After a node has failed, how long the other nodes may take to notice and stop by themselves.
SURVIVOR_GRACE_S = 30.0
#: After SIGTERM, how long a node agent may take to stop its workers before SIGKILL: longer
#: than the 30 s torchrun's agent itself gives its workers, so that it can finish that.
TERMINATE_GRACE_S = 45.0


class Simulation:
    def __init__(self, setups: list[NodeSetup]) -> None:
        self.setups = setups
        self.nodes: list[subprocess.Popen[bytes]] = []
        self._signalled: int | None = None
        self._stopped: set[subprocess.Popen[bytes]] = set()  # signalled here (the others ended by themselves)

    def run(self) -> int:
        with handling((signal.SIGINT, signal.SIGTERM), self._on_signal):
            try:
                with handling(PASSED_ON):
                    self._start()
                    codes = self._supervise()
            finally:
                self._stop_all()
        return self._outcome(codes)

    def _start(self) -> None:
        for setup in self.setups:
            setup_path = (Path(setup.run_dir) / "setups" / f"{setup.node_label}.json").resolve()
            setup_path.parent.mkdir(parents=True, exist_ok=True)
            setup_path.write_text(setup.to_json())
            env = {**os.environ, **WorkerEnv(launcher_pid=os.getpid()).to_env()}
            # A session of its own: a terminal's Ctrl-C reaches this process alone, which passes it on
            # once (an agent that got it twice would take the second for "kill at once").
            self.nodes.append(subprocess.Popen([sys.executable, "-m", "phalanx.launch.agent", str(setup_path)], env=env,
                                               start_new_session=True))  # fmt: skip

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signalled = signum
        for node in self.nodes:
            if node.poll() is None:
                self._stopped.add(node)
                node.send_signal(signum)

    def _supervise(self) -> list[int]:
        failed_at: float | None = None
        while any(node.poll() is None for node in self.nodes):
            if failed_at is None and any(node.returncode not in (None, 0) for node in self.nodes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > SURVIVOR_GRACE_S:
                say(f"phalanx: a node failed {SURVIVOR_GRACE_S:g} s ago and the others still run; stopping them")
                break
            time.sleep(0.1)
        self._stop_all()
        return [node.returncode for node in self.nodes]

    def _stop_all(self) -> None:
        running = [node for node in self.nodes if node.poll() is None]
        for node in running:
            self._stopped.add(node)
            node.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for node in running:
            try:
                node.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()

    def _outcome(self, codes: list[int]) -> int:
        if self._signalled is not None:
            return 128 + self._signalled
        if all(code == 0 for code in codes):
            return ExitCode.OK
        for said in (ExitCode.PREEMPTED, ExitCode.NOT_DISTRIBUTED):
            if said in codes and set(codes) <= {ExitCode.OK, said}:
                return said  # every node said why already
        reports = [failure_file(setup) for setup in self.setups]
        found = [item for path in reports if path.exists() for item in failure.load_failures(path)]
        # ended by a signal phalanx did not send, before it could write its report (an agent that
        # reported and then aborted at exit is not the cause: its report says what was)
        killed = [(setup, -code) for setup, node, code in zip(self.setups, self.nodes, codes) if code < 0
                  and node not in self._stopped and not failure_file(setup).exists()]  # fmt: skip
        if killed:
            say(_killed_node(*killed[0], found))
            return ExitCode.FAILED
        if found:
            say(failure.format_root_cause(found))
            return failure.exit_code_for(found)
        # No worker failed: a node refused or timed out before training; its message says why.
        return next((code for code in codes if code in (ExitCode.REFUSED, ExitCode.JOIN_TIMEOUT)), ExitCode.FAILED)


def _killed_node(setup: NodeSetup, signum: int, consequences: list[failure.RankFailure]) -> str:
    """The root cause when a simulated node's agent was killed from outside (kill -9, the
    out-of-memory killer): its workers died with it, and the other nodes' failures came after."""
    lines = [
        f"phalanx: root cause: {setup.node_label} ({setup.local_addr}): its node agent was killed by "
        f"{failure.signal_name(signum)}, not by phalanx; its workers ended with it"
    ]
    if consequences:
        ranks = ", ".join(str(item.rank) for item in sorted(consequences, key=lambda item: item.rank))
        lines.append(f"  then failed too, having lost their peers: rank(s) {ranks}")
    return "\n".join(lines)
