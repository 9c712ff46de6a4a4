"""Runs one node: the lobby, then torchrun's elastic agent in this very process (a simulated
node's own process: ``python -m phalanx.launch.agent SETUP.json``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from phalanx.console import ranges, say
from phalanx.errors import JoinTimeout, PhalanxError
from phalanx.exit_codes import ExitCode
from phalanx.launch import failure, out_of_memory
from phalanx.launch.crossnode import GATHER_TIMEOUT_S, CrossNode, NodeBoard
from phalanx.launch.fingerprint import node_fingerprint
from phalanx.launch.group_record import GROUP_RECORD_NAME, GroupRecord, solo_ranks, uncounted_ranks
from phalanx.launch.group_record import hint_for as group_hint
from phalanx.launch.heal_lost import LostNodeHeal
from phalanx.launch.keep_request import KEEP_BOUND_S, ask_to_keep, read_report, running, wait_for_reports
from phalanx.launch.liveness import WATCHED, Liveness, beat_of
from phalanx.launch.lobby import Lobby, host_store, ring_after
from phalanx.launch.node_setup import NodeSetup
from phalanx.launch.rank_table import format_rank_table, node_row
from phalanx.launch.reachability import CHECK_BOUND_S, Reachability, interface_variables, workers_interface
from phalanx.launch.restarts import RoundTimes, raise_if_signal, restarts_only_when_they_can_help
from phalanx.launch.rounds import agree_on_round
from phalanx.launch.second_signal import second_signal_kills
from phalanx.launch.signals import PASSED_ON, die_with_parent, handling
from phalanx.launch.start_report import FIRST_START, START_FINISH_S, StartReporter, process_started_at, restart
from phalanx.launch.torchrun import torchrun_argv, torchrun_env
from phalanx.quick_exit import exit_quickly
from phalanx.settings.values import Endpoint, parse_endpoint
from phalanx.torch_compat import installed_torch
from phalanx.worker_env import KEEP_REQUEST_NAME, WorkerEnv, keep_report_of

if TYPE_CHECKING:
    from phalanx.launch.logs import RankLogsSpecs


def failure_file(setup: NodeSetup) -> Path:
    return Path(setup.run_dir) / "failures" / f"{setup.node_label}.json"


class NodeAgent:
    """One node of a job: the lobby with the other nodes, then torchrun's elastic agent for this
    node's workers, then what the job's end says (the root cause, the check that the ranks
    communicated). ``run()`` returns the node's exit code."""

    def __init__(self, setup: NodeSetup) -> None:
        #: This node's setup (its endpoint gets the port the system picked, for a single node).
        self.setup = setup
        #: The rendezvous store once the nodes met, shared with torchrun's (None: a single node).
        self.store: Any = None
        #: The rank table of the current rendezvous round, on the store.
        self.board: NodeBoard | None = None
        #: Keys of the whole job on the store: the lobby's, the liveness watch's (alive, ended, lost).
        self.prefix = f"phalanx/{setup.rdzv_id}/"
        #: What the nodes tell each other on the store (:mod:`.crossnode`); its store is set once they met.
        self.crossnode = CrossNode(None, self.prefix, setup.node_label)
        #: The rendezvous rounds this node took part in; whether the latest is the job's first, its times.
        self.rounds = 0
        self.round_is_first = True
        self.round_times = RoundTimes(None, 0.0)
        #: The name the nodes of the latest round agreed on (None: one node, or before the first).
        self.round_name: str | None = None
        #: The nodes in the job's current round (from the lobby, then from torchrun's rank assignment).
        self.nodes_in_job = setup.nnodes_min
        #: The nodes whose beats this node watches: the next ones in the order of the lobby.
        self.watched: list[str] = []
        #: The watch of the next nodes' beats (a multi-node job of a fixed size).
        self.liveness: Liveness | None = None
        #: Why a node counts as lost, once the liveness watch said so.
        self.lost: str | None = None
        #: Heal mode's answer to a lost node (None without --heal).
        self.heal = LostNodeHeal(setup, self._keep_then_kill, self._keep_requests) if setup.heal else None
        self._alone_store: Any = None  # one node's store (host_store), which torchrun's shares
        #: The per-rank log layout of this node's workers (set as torchrun's agent starts).
        self.logs: RankLogsSpecs | None = None
        #: When the start's phases began (Unix times: ``launched``, ``agent``, ``met``, ``started``).
        self.start_times: dict[str, float] = {}
        #: Reports where the latest start's seconds went, once its workers stepped (:mod:`.start_report`).
        self.start_reporter: StartReporter | None = None
        #: The kernel's out-of-memory kills since the latest workers started (:mod:`.out_of_memory`).
        self.oom_watch: out_of_memory.OomWatch | None = None

    def run(self) -> int:
        os.environ.update({**torchrun_env(self.setup), **WorkerEnv(launcher_pid=os.getpid()).to_env()})
        with handling(PASSED_ON):  # from the lobby on: a notice before the workers start is kept for them
            return self._run()

    def _run(self) -> int:
        import torch.distributed  # noqa: F401  (the store and the agent need it: its import is the launcher's start)

        launcher = os.getppid() if self.setup.is_simulated else os.getpid()  # a simulated node's is its parent
        self.start_times = {"launched": process_started_at(launcher), "agent": time.time()}
        try:
            if self.setup.nnodes_max > 1:
                lobby = Lobby(self.setup, node_fingerprint(self.setup))
                fixed = not self.setup.nnodes.is_elastic  # the liveness watch's jobs
                meeting = lobby.join(watch=WATCHED if fixed else 0)
                self.nodes_in_job, self.watched = meeting.count, meeting.watched
                self.store = lobby.store
                if fixed:  # an elastic job's nodes are checked in each round (_on_ranks_assigned)
                    self._check_reachability(meeting.index, meeting.count, self.prefix)
                self.crossnode = CrossNode(self.store, self.prefix, self.setup.node_label)
            elif self.setup.store_address:  # one node: its store on that address alone, torchrun's shares it
                endpoint = parse_endpoint(self.setup.rdzv_endpoint, port_zero=True)  # 0: the system picks one
                self._alone_store = host_store(self.setup, endpoint)  # kept for torchrun, not read here
                port = self._alone_store.port
                self.setup = dataclasses.replace(self.setup, rdzv_endpoint=str(Endpoint(endpoint.host, port)))
            self.start_times["met"] = time.time()
            # Heal mode as set (0: off, whatever this shell's variables say), and the store the healing
            # ranks meet on: this launch's, which outlives any worker.
            os.environ.update(WorkerEnv(heal=self.setup.heal, heal_store=self.setup.rdzv_endpoint).to_env())
            return self._launch()
        except PhalanxError as error:
            say(error.render())
            return error.exit_code

    def _check_reachability(self, index: int, count: int, prefix: str) -> None:
        """That the peers reach this node where its workers will listen (:mod:`.reachability`):
        node ``index`` of ``count``, on the store's keys under ``prefix``."""
        interface = workers_interface(self.setup.backend, os.environ)
        if interface is None and self.rounds <= 1:  # said once (an elastic job checks every round)
            variables = interface_variables(self.setup.backend)
            named = " and ".join(f"{name}={os.environ.get(name, '')!r}" for name in variables)
            say(f"phalanx: {self.setup.node_label}: not checking that the peers reach this node's workers: "
                f"{named} {'names' if len(variables) == 1 else 'name'} no single interface of this host")  # fmt: skip
        Reachability(self.store, prefix, index, count, self.setup.node_label, interface,
                     self.setup.is_host).check()  # fmt: skip

    def _launch(self) -> int:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
        from torch.distributed.launcher.api import elastic_launch
        from torch.distributed.run import config_from_args, get_args_parser

        from phalanx.launch.logs import RankLogsSpecs

        args = get_args_parser().parse_args(torchrun_argv(self.setup, logs_specs_by_name=False))  # set below
        config, entrypoint, entrypoint_args = config_from_args(args)
        logs = RankLogsSpecs(
            log_dir=self.setup.run_dir,
            local_ranks_filter=config.logs_specs._local_ranks_filter,
            on_ranks_assigned=self._on_ranks_assigned,
        )
        config.logs_specs = self.logs = logs

        def found_in(failures: dict[int, Any]) -> list[failure.RankFailure]:
            node, address = self.setup.node_label, self.setup.local_addr
            return failure.failures_from(failures, logs.stderr_of_rank, node, address, self.oom_watch)

        def finished(timeout: float, nodes_waiting: Callable[[], int]) -> bool:
            if self.start_reporter is not None:  # posted before the others hear that this node finished
                self.start_reporter.finish(timeout=0.0)
            left = self.heal.nodes_left(self.store, self._start_name()) if self.heal is not None else []  # (elastic)
            everyone = self.crossnode.workers_finished(timeout, nodes_waiting, self.nodes_in_job - len(left),
                                                       self.setup.is_host, left=bool(left))  # fmt: skip
            if everyone and self.start_reporter is not None:  # every node posted; the store's host waits in
                self.start_reporter.finish(timeout=START_FINISH_S)  # torch's exit barrier, so its store is up
            return everyone

        judge = lambda failures, left: self._restart_helps(found_in(failures), left)  # noqa: E731
        if self.store is not None and not self.setup.nnodes.is_elastic:
            self._start_liveness()  # an elastic job watches each round's nodes in heal mode, else none
        wait_s = getattr(config, "shutdown_timeout", None) or 30
        try:
            with (
                restarts_only_when_they_can_help(judge, finished=finished, new_round=self._new_round),
                second_signal_kills(lambda sig: self._say_stopping(sig, wait_s)),
            ):
                elastic_launch(config, entrypoint)(*entrypoint_args)
        except ChildFailedError as error:
            found = found_in(error.failures)
            self.crossnode.post_failures(found)
            if self.lost is not None:
                say(f"phalanx: {self.setup.node_label}: its workers were stopped, since {self.lost}")
                self._keep_store_for_the_verdict()
                return ExitCode.FAILED
            self._say_what_was_kept()
            if failure.is_preemption(found):
                say(f"phalanx: {self.setup.node_label}: the workers stopped for preemption after saving a checkpoint; "
                    "run the same command again to continue")  # fmt: skip
                return ExitCode.PREEMPTED
            return self._report_failures(found)
        except RendezvousTimeoutError:
            raise JoinTimeout(
                f"torchrun's rendezvous at {self.setup.rdzv_endpoint} timed out after {self.setup.join_timeout:g} s",
                "the nodes met in phalanx's lobby, but not all of them came back to torchrun's rendezvous "
                "(a node may have died or been restarted).",
                "look at the other nodes' consoles; raise --join-timeout if restarts are slow",
            ) from None
        except RendezvousError as error:  # closed, or its store gone with the node that hosted it
            self._say_what_was_kept()
            say(
                f"phalanx: {self.setup.node_label}: the job's rendezvous ended ({type(error).__name__}): another node "
                "finished or failed first; look at the node that holds rank 0 for the root cause"
            )
            return ExitCode.FAILED
        except SignalException as error:
            say(f"phalanx: {self.setup.node_label} stopped by {error.sigval.name}; {self._what_the_workers_did(logs)}")
            return 128 + int(error.sigval)
        finally:
            if self.start_reporter is not None:
                self.start_reporter.stop()
            if self.liveness is not None:  # however this node ends, its silence from now on is no loss
                self.crossnode.post_ended()
                self.liveness.stop()
        return self._check_everyone_joined(logs)

    def _say_stopping(self, sig: signal.Signals, wait_s: int) -> None:
        again = "Ctrl-C" if sig == signal.SIGINT else sig.name
        say(f"phalanx: {self.setup.node_label}: {sig.name}: stopping the workers; they get up to {wait_s} s to end, "
            f"then SIGKILL ({again} again kills them now)")  # fmt: skip

    # -- rounds ----------------------------------------------------------------------------
    def _new_round(self, round_store: Any, times: RoundTimes) -> None:
        """After each rendezvous round: from now on, what this node posts and reads is the new round's."""
        self.rounds += 1
        self.round_times = times
        self.round_name = None
        if self.heal is not None:
            self.heal.enter_round(0, None)  # until the round's rank table is known
        if self.store is None:
            self.round_is_first = self.rounds == 1
            return
        name = agree_on_round(self.store, self.prefix, round_store, fallback=f"{self.setup.node_label}-{self.rounds}")
        self.round_name = name
        self.round_is_first = self._is_the_jobs_first_round(name)
        self.crossnode.enter_round(name)
        self.board = NodeBoard(self.store, self.crossnode.round_prefix, "rank_table")

    def _is_the_jobs_first_round(self, name: str) -> bool:
        """Whether round ``name`` is the job's first, alike on every node of the round (the first
        round's nodes write its name; without the store, this node's first round is taken)."""
        try:
            return self.store.compare_set(f"{self.prefix}first_round", "", name).decode() == name
        except Exception as error:
            raise_if_signal(error)
            return self.rounds == 1

    # -- nodes that are gone ---------------------------------------------------------------
    def _watch_the_rounds_nodes(self, row: dict[str, Any], rows: list[dict[str, Any]] | None) -> None:
        """Heal mode in an elastic job: the liveness watch over this round's nodes (``rows``, its rank
        table; None: not every node posted its row), and the ranks each holds (:mod:`.heal_lost`)."""
        assert self.heal is not None
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None
        self.heal.enter_round(
            row["world_size"], None if rows is None else {other["label"]: other["ranks"] for other in rows}
        )
        if rows is None:
            say(f"phalanx: {self.setup.node_label}: not every node of the round posted its ranks within "
                f"{GATHER_TIMEOUT_S:g} s: no liveness watch in this round (a node lost in it is not healed: the ranks "
                "wait for it up to their group's timeout, then leave it to --max-restarts)")  # fmt: skip
            return
        labels = [other["label"] for other in sorted(rows, key=lambda other: other["node"])]
        self.watched = [labels[index] for index in ring_after(row["node"], len(labels), WATCHED)]
        self._start_liveness()

    def _start_liveness(self) -> None:
        endpoint = parse_endpoint(self.setup.rdzv_endpoint)
        self.liveness = Liveness(
            endpoint.host, endpoint.port, self.prefix, self.setup.node_label, self.watched,
            ended=self.crossnode.ended_nodes, on_lost=self._on_lost, verdicts=self.crossnode.lost_verdicts,
            beat_s=beat_of(self.setup.heartbeat_timeout), lost_after_s=self.setup.heartbeat_timeout,
            store_host=str(endpoint), keep_watching=bool(self.setup.heal),
            on_back=self.heal.back if self.heal is not None else lambda _node: None,
        )  # fmt: skip
        self.liveness.start()

    def _on_lost(self, why: str, store_lost: bool, heard: bool) -> None:
        """From the liveness thread: stops this node's workers, whose collectives wait for the lost
        node, once each rank kept its state (:mod:`.keep_request`); in heal mode they heal instead
        where they can (:mod:`.heal_lost`). Where the store's host is lost, this process ends too:
        every store call left would wait out its timeout, and there is nothing left to save."""
        if self.heal is not None and self.heal.instead(why, store_lost, heard, self.store, self._start_name()):
            return
        if self.liveness is not None:
            self.liveness.keep_watching = False  # the workers stop: the job ends
        self.lost = why
        say(f"phalanx: PROBLEM: {self.setup.node_label}: {why}: it is lost (its machine down, or its network cut); "
            "stopping this node's workers\nHINT: check that node; once it is back, run the same command on every "
            "node: a phalanx.Run script resumes after the last step its ranks kept, else from its last checkpoint")  # fmt: skip
        if not store_lost and not heard:  # for the other nodes: each stops its workers, and says the cause first
            self.crossnode.post_lost(why)
        workers = [p for p in psutil.Process().children(recursive=True) if running(p)]  # no zombies
        self._keep_then_kill(workers, f"{why}, so its launcher stopped this rank")
        if store_lost or not workers:  # nothing of torch's agent to wait for (its exit barrier, a rendezvous)
            sys.stdout.flush()
            os._exit(ExitCode.FAILED)

    def _keep_then_kill(self, processes: list[psutil.Process], why: str,
                        unless: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        """Asks this node's ranks to keep the state after their last step (:mod:`.keep_request`),
        waits for them, then, unless ``unless()`` says otherwise, kills ``processes``."""
        requests = self._keep_requests()
        asked = ask_to_keep(requests, f"{self.setup.node_label}: {why}")
        if processes and asked:
            ranks, their = (f"{len(asked)} ranks", "their") if len(asked) > 1 else ("its rank", "its")
            say(f"phalanx: {self.setup.node_label}: waiting for {ranks} to keep the state after {their} last step "
                f"(at most {KEEP_BOUND_S:g} s)")  # fmt: skip
            wait_for_reports(asked, processes)
        self._say_what_was_kept()  # asked, or failed on their own before (a peer's sockets closed)
        for report in map(keep_report_of, requests):  # it would answer the next request at once
            with contextlib.suppress(OSError):
                report.unlink()
        if unless():
            return
        for request in requests:  # a killed rank leaves its FIFO; a replacement makes its own
            with contextlib.suppress(OSError):
                request.unlink()
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()

    def _start_name(self) -> str | None:
        """The name of the workers' latest start, alike on every node (``WorkerEnv.start_name``):
        the rendezvous round's where the nodes agreed on one, else its count (None before the first)."""
        if self.logs is None or self.logs.attempt < 0:
            return None
        return self.round_name or f"start-{self.logs.attempt}"

    def _keep_requests(self) -> list[Path]:
        """Each of this node's ranks' keep request, in the latest attempt."""
        return [folder / KEEP_REQUEST_NAME for folder in (self.logs.folder_of_rank.values() if self.logs else ())]

    def _say_what_was_kept(self) -> None:
        """After this node's workers failed: what its ranks kept of the last step, unless the
        console showed it (one line: the rank that wrote the state, else the first that said)."""
        if self.logs is None:
            return
        reports = {
            rank: read_report(folder / KEEP_REQUEST_NAME) for rank, folder in sorted(self.logs.folder_of_rank.items())
        }
        said = {rank: report for rank, report in reports.items() if report is not None}
        if said and not self.logs.shown_ranks & said.keys():
            rank = next((r for r, report in said.items() if report.startswith("this rank kept")), next(iter(said)))
            say(f"phalanx: {self.setup.node_label}: rank {rank}: {said[rank]}")

    def _keep_store_for_the_verdict(self) -> None:
        """On the store's host, stopped for a lost node: keeps the store up until every other node
        posted how it ended (one that does not watch the lost node hears the verdict on its next
        beat), at most two beats after their ranks kept the state."""
        if not self.setup.is_host or self.store is None:
            return
        deadline = time.monotonic() + 2 * beat_of(self.setup.heartbeat_timeout) + KEEP_BOUND_S
        while time.monotonic() < deadline:
            try:
                if len(self.crossnode.ended_nodes(self.store) - {self.setup.node_label}) >= self.nodes_in_job - 2:
                    return
            except Exception as error:
                raise_if_signal(error)
                return
            time.sleep(0.2)

    def _check_everyone_joined(self, logs: RankLogsSpecs) -> int:
        """After a success: whether this node's ranks joined the job's process group, or each ran alone."""
        if self.setup.independent_ranks:
            return ExitCode.OK
        records = _exit_records(logs)
        alone = solo_ranks(records)
        if not alone:
            self._say_if_uncounted(uncounted_ranks(records))
            return ExitCode.OK
        world = next(record.world_size for record in records.values() if record is not None)
        say(
            f"phalanx: PROBLEM: {self.setup.node_label}: rank{'s' if len(alone) > 1 else ''} {ranges(alone)} of the "
            f"job's {world} never communicated with the others (no collective in a process group of the whole "
            f"job): each trained alone, so nothing was distributed (their logs: {logs.root_log_dir})\n"
            f"HINT: {group_hint([r for r in records.values() if r is not None])}"
        )
        return ExitCode.NOT_DISTRIBUTED

    def _what_the_workers_did(self, logs: Any) -> str:
        """After a stop signal: how this node's workers ended, from the records they wrote at exit."""
        records = _exit_records(logs)
        if not records:
            return "no worker had started"
        killed = sorted(rank for rank, record in records.items() if record is None)
        stopped = {record.stopped for record in records.values() if record is not None and record.stopped}
        if killed:
            if len(killed) == len(records):
                return "its workers were killed before they ended on their own"
            who = f"ranks {ranges(killed)} were" if len(killed) > 1 else f"rank {killed[0]} was"
            return f"{who} killed before they ended on their own"
        every_rank_stopped = len(stopped) == 1 and all(record.stopped for record in records.values() if record)
        return f"its workers stopped {stopped.pop()}" if every_rank_stopped else "its workers ended on their own"

    def _say_if_uncounted(self, ranks: list[int]) -> None:
        """Says that the check above could not see the collectives, rather than pass or fail blind."""
        if not ranks:
            return
        from phalanx.runtime.watchdog import FLIGHT_RECORDER_ENTRIES, FLIGHT_RECORDER_VARIABLE

        who, they = (f"ranks {ranges(ranks)}", "they") if len(ranks) > 1 else (f"rank {ranks[0]}", "it")
        say(f"phalanx: note: {self.setup.node_label}: torch {installed_torch()}'s flight recorder did not count the "
            f"collectives of {who}, so phalanx cannot tell whether {they} communicated with the others, only that "
            f"{they} joined the job's process group (export {FLIGHT_RECORDER_VARIABLE}={FLIGHT_RECORDER_ENTRIES} lets it count them)")  # fmt: skip

    def _restart_helps(self, found: list[failure.RankFailure], remaining: int) -> bool:
        """Whether to restart the workers after these failures, said on the console either way; a
        node that ends the job tells the others."""
        node, most = self.setup.node_label, self.setup.max_restarts
        lost = self.lost or (self.heal.waited_for() if self.heal is not None else None)
        reason = failure.restart_cannot_help(found) or (f"{lost}: a restart would wait for it" if lost else None)
        if reason is not None:
            self.crossnode.post_end_of_job(f"{node} ends the job: {reason}")
        else:
            reason = self.crossnode.end_of_job_posted()
        if reason is not None:
            say(f"phalanx: {node}: not restarting the workers (--max-restarts {most}): {reason}")
            return False
        number = most - remaining + 1
        say(f"phalanx: {node}: {failure.in_one_line(found)}; restarting the workers (restart {number} of {most})")
        return True

    # -- hooks ---------------------------------------------------------------------------
    def _on_ranks_assigned(self, envs: dict[int, dict[str, str]]) -> None:
        """Called by torch's agent right before it starts the workers (from their logs' layout): the
        rank table, an elastic round's reachability check and liveness watch, the start report."""
        row = node_row(envs, self.setup.local_addr, self.setup.node_label)
        if self.oom_watch is not None:
            self.oom_watch.close()
        self.oom_watch = out_of_memory.OomWatch()  # the workers start now: a kill from here on may be theirs
        for env in envs.values():  # the workers are started with these dicts
            env.update(WorkerEnv(start_name=self._start_name()).to_env())
        self.nodes_in_job = row["nodes"]
        elastic = self.setup.nnodes.is_elastic and self.store is not None
        if elastic:  # each round's check; a node gone ends no job here: torch forms a round without it
            try:
                self._check_reachability(row["node"], row["nodes"], self.crossnode.round_prefix)
            except JoinTimeout:
                say(f"phalanx: {self.setup.node_label}: not every node of this round checked that its peers reach it "
                    f"within {CHECK_BOUND_S:g} s (a node gone?); starting the workers: torch's agent forms a round "
                    "without a node that is lost")  # fmt: skip
        watch = elastic and self.heal is not None
        if self.board is not None:
            self.board.post(row["node"], row)
        rows = None  # also where not every node posted its row within GATHER_TIMEOUT_S
        if watch or 0 in row["ranks"]:
            rows = [row] if self.board is None else self.board.gather(row["nodes"])
        if 0 in row["ranks"] and rows is not None:
            say(format_rank_table(rows))
        elif 0 in row["ranks"]:
            say(f"phalanx: rank table: not every node posted its ranks within {GATHER_TIMEOUT_S:g} s; continuing "
                "without the table")  # fmt: skip
        if watch:
            self._watch_the_rounds_nodes(row, rows)
        if self.setup.command_name == "phalanx run":
            try:
                self._report_the_start(row)
            except Exception as error:  # a report, never a reason for torch's agent to fail
                raise_if_signal(error)

    def _report_the_start(self, row: dict[str, Any]) -> None:
        """Reports where this start's seconds went once the workers stepped (:mod:`.start_report`);
        the round before's report, unsaid, stops."""
        assert self.logs is not None
        if self.start_reporter is not None:
            self.start_reporter.stop()
        if self.round_is_first:  # from `phalanx run` on
            times, kind = self.start_times, FIRST_START
        else:  # a node new to the job (it joined an elastic job later) counts from its rendezvous
            ended, began = self.round_times
            times, kind = {"ended": began if ended is None else ended, "began": began}, restart(row["attempt"])
        board = None if self.store is None else NodeBoard(self.store, self.crossnode.round_prefix, "start")
        self.start_reporter = StartReporter(
            {**times, "started": time.time()}, self.setup.node_label,
            [self.logs.folder_of_rank[rank] for rank in row["ranks"]],
            post=None if board is None else lambda phases: board.post(row["node"], phases),
            gather=None if board is None or 0 not in row["ranks"] else lambda: board.gather(row["nodes"], timeout=0),
            report=say, run_dir=Path(self.setup.run_dir), kind=kind,
        )  # fmt: skip
        self.start_reporter.start()

    def _report_failures(self, found: list[failure.RankFailure]) -> int:
        """Names the root cause; the exit code that goes with it."""
        failure.save_failures(found, failure_file(self.setup))
        if self.setup.is_simulated:  # the simulating parent merges every node's file and names the root cause once
            return failure.exit_code_for(found)
        everyone = found + self.crossnode.failures_of_other_nodes(found, self.nodes_in_job)
        for verdict in self.crossnode.lost_verdicts():
            say(f"phalanx: a node was lost first, {verdict}; the failures below followed from it")
        say(failure.format_root_cause(everyone))
        silent = self._silent_nodes()
        if silent:
            say(f"phalanx: {self.setup.node_label}: no word from {', '.join(silent)} (neither finished nor failed): "
                "it may be gone with its workers (killed, or its machine down), and the failures above the "
                "consequence")  # fmt: skip
        return failure.exit_code_for(everyone)

    def _silent_nodes(self) -> list[str]:
        """The nodes of this round (those that posted their row of its rank table, not those of the
        lobby) that posted neither a finish nor a failure (best effort)."""
        if self.store is None or self.board is None:
            return []
        try:
            nodes = [row["label"] for row in self.board.posted(self.nodes_in_job)]
            ended = self.crossnode.ended_nodes(self.store)
        except Exception as error:
            raise_if_signal(error)
            return []
        return [node for node in nodes if node != self.setup.node_label and node not in ended]


def _exit_records(logs: Any) -> dict[int, GroupRecord | None]:
    """Each of this node's ranks' exit record (None: it wrote none, it was killed)."""
    return {rank: GroupRecord.read(folder / GROUP_RECORD_NAME) for rank, folder in logs.folder_of_rank.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent(WorkerEnv.from_env(os.environ).launcher_pid)  # a simulated node dies with its simulation
    setup = NodeSetup.from_json(Path(argv[0]).read_text())
    return NodeAgent(setup).run()


if __name__ == "__main__":
    exit_quickly(main())
