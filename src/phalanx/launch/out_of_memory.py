"""Whether the kernel's out-of-memory killer ended a worker, in the kernel's own words.

A worker the OOM killer ends dies of SIGKILL with nothing in its stderr; one whose DataLoader
worker it ends fails with "DataLoader worker (pid(s) 1234) exited unexpectedly". The kernel counts
its kills (``oom_kill`` in /proc/vmstat, a cgroup's limit included) and logs each one with the
pid in /dev/kmsg, which root can read (and everyone where kernel.dmesg_restrict is 0).
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

VMSTAT = Path("/proc/vmstat")
KMSG = Path("/dev/kmsg")
#: The kernel's line for each kill: "Out of memory: Killed process 5405 (python3) total-vm:..."
#: ("Memory cgroup out of memory: ..." where a cgroup's limit was reached).
_KILLED = re.compile(r"Killed process (\d+) \(")
#: How an error names other processes: torch's DataLoader says "DataLoader worker (pid(s) 1234, 1235)
#: exited unexpectedly" or "DataLoader worker (pid 1234) is killed by signal: Killed."
_PIDS = re.compile(r"\bpid(?:\(s\))?:? ([\d, ]+)")
#: The most of the kernel's log read at a time.
_LOG_MAX_BYTES = 4 * 1024**2

HINT = (
    "give each worker less to hold (a smaller batch, fewer DataLoader workers or a lower prefetch_factor), or the "
    "job more memory (SLURM's --mem, the container's memory limit); the kernel's log (dmesg) lists what each "
    "process held"
)


def kills(vmstat: Path = VMSTAT) -> int | None:
    """Processes the kernel has killed for want of memory since it booted; None where it does not say."""
    try:
        text = vmstat.read_text()
    except OSError:
        return None
    found = re.search(r"^oom_kill (\d+)$", text, re.M)
    return int(found.group(1)) if found else None


class OomWatch:
    """The kernel's out-of-memory kills from the moment it is made (when workers start): its count,
    and its log from that point on, where the log can be read.

    Args:
        vmstat: where the kernel counts its kills.
        kmsg: the kernel's log.
    """

    def __init__(self, vmstat: Path = VMSTAT, kmsg: Path = KMSG) -> None:
        self._vmstat = vmstat
        self.at_start = kills(vmstat)
        self._killed: list[tuple[int, str]] = []  # (pid, the kernel's line), oldest first
        try:
            self._log: int | None = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._log, 0, os.SEEK_END)  # /dev/kmsg: after the last record
        except OSError:
            self._log = None

    def close(self) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None

    def explain(self, pid: int, exitcode: int, tail: tuple[str, ...] = ()) -> str:
        """Words that follow the name of a failed process when the OOM killer ended it, or a
        process its stderr names (a DataLoader worker), since the watch began; empty when it did
        not, or when the kernel does not say.

        Args:
            pid: the process id.
            exitcode: how it ended (a negative number for a signal).
            tail: the end of its stderr.
        """
        now = kills(self._vmstat)
        if self.at_start is None or now is None or now <= self.at_start:
            return ""
        self._read_log()
        killed = dict(self._killed)
        if pid in killed:
            return f"the kernel's out-of-memory killer ended it: {killed[pid]}"
        named = {int(number) for words in _PIDS.findall("\n".join(tail)) for number in re.findall(r"\d+", words)}
        others = sorted(named & set(killed))
        if others:
            return f"the kernel's out-of-memory killer ended its process {others[0]}: {killed[others[0]]}"
        if exitcode != -signal.SIGKILL:
            return ""
        # No line names it: the log cannot be read, or its pids are another pid namespace's.
        count = now - self.at_start
        last = f"; the kernel's log: {self._killed[-1][1]}" if self._killed else ""
        return (f"most likely the kernel's out-of-memory killer: it ended {count} process{'es' if count > 1 else ''} "
                f"on this machine meanwhile{last}")  # fmt: skip

    def _read_log(self) -> None:
        """Reads the records written since the last read (one a read on /dev/kmsg)."""
        if self._log is None:
            return
        chunks, size = [], 0
        for _ in range(_LOG_MAX_BYTES // 64):  # a record is 64 bytes or more
            if size >= _LOG_MAX_BYTES:
                break
            try:
                chunk = os.read(self._log, 65536)
            except BlockingIOError:  # no record more
                break
            except BrokenPipeError:  # records overwritten before they were read: the next one follows
                continue
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        for record in b"".join(chunks).decode(errors="replace").splitlines():
            text = record.split(";", 1)[-1].strip()  # "priority,sequence,time,flags;message"
            match = _KILLED.search(text)
            if match:  # up to the memory it held: "..., anon-rss:72192kB", not every other figure
                self._killed.append((int(match.group(1)), re.sub(r"(anon-rss:\d+kB),.*", r"\1", text)))
