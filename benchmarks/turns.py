"""Two launched jobs that train in turns, one block of optimizer steps at a time.

On a shared machine the load of a neighbour comes and goes over seconds, so two runs seconds
apart can differ by more than the overhead being measured. Here both jobs are started together
and take turns: every rank stops at each block boundary and waits for its job's turn, so the
blocks of the two jobs alternate a fraction of a second apart, and a neighbour's burst hits a
phalanx block and the plain block next to it alike.

The referee (:class:`Referee`, in the benchmark's own process) hands out the turns over a Unix
socket; each rank (:class:`Turns`) reports at every boundary, and times its own blocks
(:class:`BlockClock`; the benchmark keeps rank 0's), turn to turn, so the wait for the other
job's block is not counted. What a paused job still does in the other's block: its background
threads (gloo's, the stall watchdog's, which polls every few seconds) may run; nothing else,
since every rank of it waits. A turn starts with caches the other job has used: short turns
reject more of the machine's noise, and add that cold start to every turn.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

#: Longest a turn may take before the referee gives up: a block is well under a second.
TURN_TIMEOUT_S = 120.0
GO, DONE, END = b"g", b"d", b"e"


class BlockClock:
    """Rank 0's clock per block of optimizer steps: wall and process CPU seconds (all threads),
    boundary to boundary, less the wait for a turn when there are turns. ``wall`` is the clock
    read at each boundary (a test hands one that records when it was read)."""

    def __init__(self, samples_per_step: int, turns: Turns | None = None, *,
                 wall: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self._per_step, self._turns, self._wall = samples_per_step, turns, wall
        self._step: int | None = None
        self._started = self._cpu_started = 0.0
        self.blocks: list[tuple[int, float, float]] = []  # (global samples, seconds, CPU seconds)

    def boundary(self, step: int) -> None:
        now, cpu_now = self._wall(), time.process_time()
        if self._step is not None:
            self.blocks.append(((step - self._step) * self._per_step, now - self._started, cpu_now - self._cpu_started))
        if self._turns is not None:
            self._turns.wait()
        self._step, self._started, self._cpu_started = step, self._wall(), time.process_time()


class Turns:
    """One rank's side: :meth:`wait` at every block boundary reports the block done (after the
    first) and returns when the job's next turn comes; after the last, it returns at once."""

    def __init__(self, path: str, job: str, rank: int) -> None:
        self._path, self._hello = path, f"{job} {rank}\n".encode()
        self._socket: socket.socket | None = None
        self._ended = False

    def wait(self) -> None:
        if self._ended:
            return
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socket.connect(self._path)
            self._socket.sendall(self._hello)
        else:
            self._socket.sendall(DONE)
        reply = self._socket.recv(1)
        if reply == END:
            self._ended = True
            self._socket.close()
        elif reply != GO:
            raise RuntimeError(f"the benchmark's referee closed the turns ({reply!r})")


class Referee:
    """Lets the jobs take turns in the order given; :meth:`run` hands out the turns and then releases them."""

    def __init__(self, path: Path, jobs: tuple[str, ...], ranks_per_job: int) -> None:
        self._jobs, self._ranks = jobs, ranks_per_job
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(len(jobs) * ranks_per_job)
        self._server.settimeout(1.0)
        self._ranks_of: dict[str, list[socket.socket]] = {job: [] for job in jobs}

    def run(self, blocks: int, running: Callable[[], bool] = lambda: True) -> None:
        """Waits for every rank's first boundary, gives each job ``blocks`` turns, then ends them.
        Raises on a rank that leaves early or a job that stops ``running`` before it connected,
        and (OSError) on a rank that takes longer than TURN_TIMEOUT_S to connect or to finish a
        block."""
        deadline = time.monotonic() + TURN_TIMEOUT_S
        for _ in range(len(self._jobs) * self._ranks):  # every rank waits at its first boundary
            connection = self._accept(running, deadline)
            connection.settimeout(TURN_TIMEOUT_S)
            job, _rank = _read_line(connection).split()
            self._ranks_of[job].append(connection)
        for _ in range(blocks):
            for job in self._jobs:
                self._tell(job, GO)
                for connection in self._ranks_of[job]:
                    if connection.recv(1) != DONE:
                        raise RuntimeError(f"a rank of the {job} job left before the end of its block")
        for job in self._jobs:  # every job waits at its last boundary until the other's last block is done
            self._tell(job, END)

    def _accept(self, running: Callable[[], bool], deadline: float) -> socket.socket:
        while True:  # in short waits: a job that died before its first step is told at once
            try:
                return self._server.accept()[0]
            except TimeoutError:
                if not running():
                    raise RuntimeError("a job ended before all its ranks reached their first turn") from None
                if time.monotonic() > deadline:
                    raise

    def _tell(self, job: str, message: bytes) -> None:
        for connection in self._ranks_of[job]:
            connection.sendall(message)

    def close(self) -> None:
        for connection in (c for ranks in self._ranks_of.values() for c in ranks):
            connection.close()
        self._server.close()


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(64)
        if not chunk:
            raise RuntimeError("a rank closed its connection before it said which job it is")
        data += chunk
    return data.decode()
