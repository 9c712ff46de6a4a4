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
#: The most of the kernel's log that is read (its ring buffer is a few MiB at most).
_KMSG_MAX_BYTES = 16 * 1024**2

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


def killed(kmsg: Path = KMSG) -> list[tuple[int, str]]:
    """The kills still in the kernel's log, oldest first: (pid, the kernel's line). Empty where it
    cannot be read."""
    try:
        descriptor = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    chunks, size = [], 0
    try:
        while size < _KMSG_MAX_BYTES:
            try:
                chunk = os.read(descriptor, 65536)  # /dev/kmsg gives one record a read
            except BlockingIOError:  # the end of the log
                break
            except BrokenPipeError:  # a record overwritten while reading: the next one follows
                continue
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(descriptor)
    found = []
    for record in b"".join(chunks).decode(errors="replace").splitlines():
        text = record.split(";", 1)[-1].strip()  # "priority,sequence,time,flags;message"
        match = _KILLED.search(text)
        if match:  # up to the memory it held: "..., anon-rss:72192kB", not every other figure
            found.append((int(match.group(1)), re.sub(r"(anon-rss:\d+kB),.*", r"\1", text)))
    return found


def explain(pid: int, exitcode: int, tail: tuple[str, ...], kills_at_start: int | None) -> str:
    """Words that follow the name of a failed worker when the OOM killer ended it, or a process
    its stderr names (a DataLoader worker), while the workers ran; empty when it did not, or when
    the kernel does not say.

    Args:
        pid: the worker's process id.
        exitcode: how it ended (a negative number for a signal).
        tail: the end of its stderr.
        kills_at_start: :func:`kills` when the workers started.
    """
    now = kills()
    if kills_at_start is None or now is None or now <= kills_at_start:
        return ""
    count = now - kills_at_start
    recent = dict(killed()[-count:])  # the log's last kills are those since the start
    if pid in recent:
        return f"the kernel's out-of-memory killer ended it: {recent[pid]}"
    named = {int(number) for words in _PIDS.findall("\n".join(tail)) for number in re.findall(r"\d+", words)}
    others = sorted(named & set(recent))
    if others:
        return f"the kernel's out-of-memory killer ended its process {others[0]}: {recent[others[0]]}"
    if exitcode == -signal.SIGKILL and not recent:  # the log cannot be read: the count is all there is
        return (f"most likely the kernel's out-of-memory killer: it ended {count} process{'es' if count > 1 else ''} "
                "on this machine while the workers ran (oom_kill in /proc/vmstat)")  # fmt: skip
    return ""
