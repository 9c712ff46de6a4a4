"""Per-rank log files, named by global rank (``<run dir>/attempt_<n>/rank<R>/``), and which ranks
the console shows; also torchrun's ``--logs-specs phalanx`` (docs/launch-design.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

from phalanx.launch.group_record import GROUP_RECORD_NAME
from phalanx.launch.start_report import START_RECORD_NAME
from phalanx.worker_env import KEEP_REPORT_NAME, KEEP_REQUEST_NAME, WorkerEnv

_RANK = "rank"  # a rank's folder: rank<R>


def rank_folders(attempt: Path) -> dict[int, Path]:
    """The log folders of a start of the workers (``attempt_<n>``) by global rank, as far as
    this host sees them."""
    found = {}
    for folder in attempt.glob(f"{_RANK}*"):
        rank = folder.name.removeprefix(_RANK)
        if rank.isdigit():
            found[int(rank)] = folder
    return found


class RankLogsSpecs(LogsSpecs):
    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.ALL,
        tee: Std | dict[int, Std] = Std.ALL,
        local_ranks_filter: set[int] | None = None,
        on_ranks_assigned: Callable[[dict[int, dict[str, str]]], None] | None = None,
    ) -> None:
        super().__init__(log_dir or "phalanx-logs", redirects, tee, local_ranks_filter)
        self.on_ranks_assigned = on_ranks_assigned
        self._starts = 0  # how often this agent started its workers: one per rendezvous round
        #: global rank -> its stderr log, for the latest attempt (read by the failure report).
        self.stderr_of_rank: dict[int, Path] = {}
        #: global rank -> its log folder, for the latest attempt.
        self.folder_of_rank: dict[int, Path] = {}
        #: The global ranks whose stderr the console shows, in the latest attempt.
        self.shown_ranks: set[int] = set()

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    @property
    def attempt(self) -> int:
        """The number of the workers' latest start (``WorkerEnv.attempt``), alike on every node."""
        return self._starts - 1

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        # counting the starts numbers the rounds alike on every node (TORCHELASTIC_RESTART_COUNT does not)
        attempt_number, self._starts = self._starts, self._starts + 1
        attempt = Path(self.root_log_dir) / f"attempt_{attempt_number}"
        self.folder_of_rank = {int(env["RANK"]): attempt / f"{_RANK}{env['RANK']}" for env in envs.values()}
        for env in envs.values():  # the workers are started with these dicts
            # absolute: a script may change its working folder (Hydra does) before it writes them
            folder = self.folder_of_rank[int(env["RANK"])].absolute()
            env.update(WorkerEnv(attempt=attempt_number, group_record=str(folder / GROUP_RECORD_NAME),
                                 keep_request=str(folder / KEEP_REQUEST_NAME)).to_env())  # fmt: skip
        if self.on_ranks_assigned is not None:
            self.on_ranks_assigned(envs)
        dest = LogsDest()
        if not envs:
            return dest
        redirects, tee = to_map(self._redirects, len(envs)), to_map(self._tee, len(envs))
        self.stderr_of_rank, self.shown_ranks = {}, set()
        for local_rank, env in envs.items():
            rank = int(env["RANK"])
            folder = self.folder_of_rank[rank]
            folder.mkdir(parents=True, exist_ok=True)
            for name in (
                "stdout.log",
                "stderr.log",
                "error.json",
                GROUP_RECORD_NAME,
                START_RECORD_NAME,
                KEEP_REQUEST_NAME,
                KEEP_REPORT_NAME,
            ):
                (folder / name).unlink(missing_ok=True)  # a restart must not show an old traceback
            to_file = redirects[local_rank] | tee[local_rank]  # a tee'd stream is tailed from its file
            shown = tee[local_rank] if self._shows(rank, local_rank) else Std.NONE
            if shown & Std.ERR:
                self.shown_ranks.add(rank)
            for stream, name, files, tees in (
                (Std.OUT, "stdout.log", dest.stdouts, dest.tee_stdouts),
                (Std.ERR, "stderr.log", dest.stderrs, dest.tee_stderrs),
            ):
                # Neither redirected nor tee'd (plain torchrun's default): the console, as torch's own
                # layout does, unless --local-ranks-filter leaves the rank out ("" is the console).
                console = self._local_ranks_filter is None or local_rank in self._local_ranks_filter
                files[local_rank] = str(folder / name) if to_file & stream else ("" if console else os.devnull)
                if shown & stream:
                    tees[local_rank] = files[local_rank]
            dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = str((folder / "error.json").absolute())
            if to_file & Std.ERR:
                self.stderr_of_rank[rank] = folder / "stderr.log"
        dest.filtered_stdout = str(attempt / f"filtered_stdout.{os.getpid()}.log")
        dest.filtered_stderr = str(attempt / f"filtered_stderr.{os.getpid()}.log")
        return dest

    def _shows(self, rank: int, local_rank: int) -> bool:
        if self._local_ranks_filter is not None:
            return local_rank in self._local_ranks_filter
        return rank == 0

    def __repr__(self) -> str:
        return f"RankLogsSpecs(root_log_dir={self._root_log_dir!r}, local_ranks_filter={self._local_ranks_filter})"
