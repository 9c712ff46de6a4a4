"""The stall watchdog says when it cannot work, instead of silently never firing, and refuses a
stall timeout that is not a positive number of seconds.

A flight recorder switched on or off is real (a gloo group of one rank in a process of its own:
torch reads the switch when the group is made). A torch without this flight recorder cannot be
installed beside the one tested here; it is stood in for by removing the function."""

from __future__ import annotations

import json
import sys
import time

import psutil
import pytest
import torch

from phalanx.errors import SettingsRefused
from phalanx.runtime.watchdog import (
    COUNTS_ONLY_POLLS,
    Progress,
    StallWatchdog,
    stall_report,
    stall_timeout_from_env,
    stood_still,
    watchdog_unavailable,
)
from tests.conftest import run_command

PROBE = """
import sys
import torch.distributed as dist
from phalanx.runtime.watchdog import watchdog_unavailable
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
dist.barrier()  # as phalanx.init does
print(watchdog_unavailable("gloo", 300) or "available")
dist.destroy_process_group()
"""


def probe(tmp_path, buffer_size: str) -> str:
    env = {"TORCH_FR_BUFFER_SIZE": buffer_size}
    result = run_command([sys.executable, "-c", PROBE, str(tmp_path / "store")], timeout=60, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.output
    return result.stdout.strip()


def test_the_watchdog_is_available_when_the_flight_recorder_records(tmp_path):
    assert probe(tmp_path, "500") == "available"


def test_a_flight_recorder_switched_off_is_named_with_a_hint(tmp_path):
    notice = probe(tmp_path, "0")
    assert notice.startswith(
        "phalanx: the stall watchdog is off: TORCH_FR_BUFFER_SIZE=0 switches off torch's flight recorder"
    )
    assert "until the backend's timeout (300 s), and no report names it" in notice
    assert notice.endswith("HINT: unset TORCH_FR_BUFFER_SIZE (phalanx sets 500)")


def test_a_torch_without_this_flight_recorder_is_named(monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace")
    notice = watchdog_unavailable("gloo", 300)
    assert notice is not None and f"torch {torch.__version__} cannot show its flight recorder (AttributeError" in notice
    assert "HINT: use a torch whose flight recorder records gloo collectives" in notice


@pytest.mark.parametrize(("argument", "variable", "says"), [
    (None, "-5", "PHALANX_STALL_TIMEOUT='-5'\n  a stall timeout is not a positive number of seconds"),
    (None, "5m", "PHALANX_STALL_TIMEOUT='5m'\n  it is not a number of seconds"),
    (0, None, "stall_timeout=0\n  a stall timeout is not a positive number of seconds"),
    (float("nan"), None, "stall_timeout=nan"),
    (float("inf"), None, "stall_timeout=inf\n  a stall timeout is longer than a week (604800 s), which bounds nothing"),
    (None, "1e11", "PHALANX_STALL_TIMEOUT='1e11'\n  a stall timeout is longer than a week (604800 s), which bounds nothing"),
])  # fmt: skip
def test_a_stall_timeout_that_is_not_positive_seconds_is_refused_with_a_hint(monkeypatch, argument, variable, says):
    if variable is None:
        monkeypatch.delenv("PHALANX_STALL_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("PHALANX_STALL_TIMEOUT", variable)
    with pytest.raises(SettingsRefused) as refused:
        stall_timeout_from_env(argument)
    assert refused.value.exit_code == 2 and says in str(refused.value)
    assert "HINT: give the seconds a collective may stay pending before the job is aborted, for example 300" in str(
        refused.value
    )


def test_the_stall_timeout_comes_from_the_argument_then_the_variable_then_the_default(monkeypatch):
    monkeypatch.setenv("PHALANX_STALL_TIMEOUT", "42.5")
    assert stall_timeout_from_env(7) == 7.0 and stall_timeout_from_env(None) == 42.5
    monkeypatch.delenv("PHALANX_STALL_TIMEOUT")
    assert stall_timeout_from_env(None) == 300.0


def serve_job_store(monkeypatch):
    """A real TCPStore, as the job's: the watchdog connects to MASTER_ADDR:MASTER_PORT."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


@pytest.fixture
def job_store(monkeypatch):
    return serve_job_store(monkeypatch)


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def test_a_poll_that_fails_is_said_once_and_so_is_its_recovery(job_store, monkeypatch, capsys):
    """The flight recorder's failure is stood in for (torch's cannot be made to fail on demand);
    the store, the thread and its polls are real."""
    said: list[str] = []

    def log() -> str:
        said.append(capsys.readouterr().err)
        return "".join(said)

    watchdog = StallWatchdog(rank=3, world_size=4, stall_timeout=300, backend="gloo", poll_s=0.05)
    watchdog.start()
    try:
        wait_for(lambda: job_store.check([f"{watchdog.prefix}3"]))  # it posts its progress
        dump = torch._C._distributed_c10d._dump_fr_trace

        def unreadable(**_kwargs):
            raise RuntimeError("flight recorder unreadable")

        monkeypatch.setattr(torch._C._distributed_c10d, "_dump_fr_trace", unreadable)
        wait_for(lambda: "cannot read the flight recorder" in log())
        time.sleep(0.5)  # about 10 more failed polls
        assert log().count("cannot read") == 1
        assert log().startswith("phalanx: the stall watchdog of rank 3 cannot read the flight recorder (RuntimeError: "
                                "flight recorder unreadable). Until it can, this rank reports no stall")  # fmt: skip
        assert "It tries again every 0.05 s" in log()
        assert "\nHINT: when the job is not ending, the flight recorder is torch's: the error above is its own" in log()
        monkeypatch.setattr(torch._C._distributed_c10d, "_dump_fr_trace", dump)
        wait_for(lambda: "phalanx: the stall watchdog of rank 3 polls again" in log())
        assert watchdog._thread.is_alive()
    finally:
        watchdog.stop()
    assert not watchdog._thread.is_alive()
    assert log().count("rank 3 polls again") == 1


def test_a_fork_waits_until_the_thread_is_out_of_torch(job_store, monkeypatch):
    """A DataLoader worker forked while the thread is inside torch inherits the C locks torch
    holds then and can hang before its first batch. The dump is stood in for by a slow one that
    marks when it runs (a real dump is microseconds: a fork would land in one too rarely to see);
    the thread, its polls and the forks are real. A fork lands inside a poll when the guard fails."""
    import os
    import threading

    inside, polls = threading.Event(), []
    real_dump = torch._C._distributed_c10d._dump_fr_trace

    def slow_dump(**kwargs):
        inside.set()
        time.sleep(0.03)
        polls.append(1)
        inside.clear()
        return real_dump(**kwargs)

    watchdog = StallWatchdog(rank=0, world_size=1, stall_timeout=300, backend="gloo", poll_s=0.005)
    watchdog.start()
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_fr_trace", slow_dump)
    try:
        wait_for(lambda: len(polls) >= 2)
        forks, landed_inside, first_poll = 0, 0, len(polls)
        while len(polls) < first_poll + 10:  # forks back to back over ten polls
            pid = os.fork()
            if pid == 0:
                os._exit(1 if inside.is_set() else 0)
            forks += 1
            landed_inside += os.waitpid(pid, 0)[1] != 0
        assert landed_inside == 0, f"{landed_inside} of {forks} forks happened while the thread was inside torch"
    finally:
        watchdog.stop()


def test_a_store_that_goes_away_is_said_once(monkeypatch, capsys):
    stores = [serve_job_store(monkeypatch)]
    port = stores[0].port
    watchdog = StallWatchdog(rank=1, world_size=2, stall_timeout=300, backend="gloo", poll_s=0.05)
    watchdog.start()
    try:
        wait_for(lambda: stores[0].check([f"{watchdog.prefix}1"]))
        stores.clear()  # the store's server closes: every later post fails
        said = ""
        deadline = time.monotonic() + 20
        while "cannot post" not in said and time.monotonic() < deadline:
            said += capsys.readouterr().err
            time.sleep(0.05)
        time.sleep(0.3)
        said += capsys.readouterr().err
    finally:
        watchdog.stop()
    assert said.count("phalanx: the stall watchdog of rank 1 cannot post to the job's store (") == 1, said
    assert f"the job's store (127.0.0.1:{port}, MASTER_ADDR:MASTER_PORT)" in said


@pytest.mark.parametrize(("previous", "now", "read_entries"), [
    (None, (("0", 5, 5),), True),  # the first poll
    ((("0", 5, 5),), None, True),  # a torch without the status
    ((("0", 5, 5),), (("0", 5, 5),), True),  # nothing moved: a stall, or no collective
    ((("0", 5, 4),), (("0", 5, 4),), True),  # pending and stuck
    ((("0", 5, 5),), (("0", 9, 8),), False),  # training: collectives complete
    ((("0", 5, 5),), (("0", 6, 5),), True),  # one issued, none completed since: may be the stall's start
    ((("0", 5, 5), ("1", 3, 3)), (("0", 9, 9), ("1", 4, 3)), True),  # group 1 stuck while group 0 works
    ((("0", 5, 5), ("1", 3, 3)), (("0", 9, 9), ("1", 3, 3)), False),  # group 1 idle, nothing pending
    ((("0", 5, 5),), (("0", 9, 9), ("1", 1, -1)), True),  # a new group's first collective, pending (as torch counts it)
    ((("0", 5, 5),), (("0", 9, 9), ("1", 1, 1)), False),  # a new group's first collective, done
])  # fmt: skip
def test_the_entries_are_read_only_when_the_counts_stood_still(previous, now, read_entries):
    assert stood_still(previous, now) is read_entries


POLLS = """
import json, sys, time
import torch, torch.distributed as dist
from phalanx.runtime import watchdog
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
dog = watchdog.StallWatchdog(rank=0, world_size=1, stall_timeout=300, backend="gloo", poll_s=1)
def all_reduce():
    dist.all_reduce(torch.ones(2))
    while (counts := watchdog.collective_counts("gloo"))[0][2] < counts[0][1]:
        time.sleep(0.001)  # gloo's thread records a completion just after wait() returns
def step_and_poll():  # training: a collective completes between two polls
    all_reduce()
    return dog._poll()
all_reduce()  # as phalanx.init's barrier
polls = [dog._poll()]  # the first poll: no counts to compare with yet
polls += [step_and_poll() for _ in range(3)]
polls.append(dog._poll())  # nothing moved since the last poll
polls += [step_and_poll() for _ in range(watchdog.COUNTS_ONLY_POLLS + 1)]
print(json.dumps([None if p is None else (p.issued, p.completed, p.last_completed_op) for p in polls]))
import os; os._exit(0)
"""


def test_polls_read_every_entry_only_when_the_counts_stand_still_or_after_many_polls(tmp_path):
    """A real flight recorder (a gloo group of one rank, in a process of its own). A poll that
    reads only the counts posts nothing (None); so does the first, which only keeps them."""
    result = run_command([sys.executable, "-c", POLLS, str(tmp_path / "store")], timeout=60, cwd=tmp_path,
                         env={"TORCH_FR_BUFFER_SIZE": "500"})  # fmt: skip
    assert result.returncode == 0, result.output
    polls = json.loads(result.stdout)
    counts_only = COUNTS_ONLY_POLLS

    def read(seq):  # (issued, completed, last completed op), per process group: only the default one here
        return [{"0": seq}, {"0": seq}, {"0": "gloo:all_reduce"}]

    assert polls == [None, None, None, None, read(4), *[None] * counts_only, read(5 + counts_only)]


def progress(rank, issued, op, step, group="0"):
    """A rank with nothing pending, whose newest collective in ``group`` was #``issued``."""
    return Progress(rank=rank, node=f"node{rank}", issued={group: issued}, completed={group: issued},
                    last_completed_op={group: op}, pending_group=None, pending_group_desc=None, pending_op=None,
                    pending_seq=None, pending_for_s=0.0, step=step)  # fmt: skip


def waiting(rank, seq, group="0", desc="default_pg"):
    """A rank whose collective #``seq`` in ``group`` has been pending for 301 s."""
    return Progress(rank=rank, node=f"node{rank}", issued={group: seq}, completed={group: seq - 1},
                    last_completed_op={group: "gloo:all_reduce"}, pending_group=group, pending_group_desc=desc,
                    pending_op="gloo:all_reduce", pending_seq=seq, pending_for_s=301.0, step=7)  # fmt: skip


def test_a_stall_report_names_the_stalled_ranks_their_last_collective_and_step():
    me = waiting(0, 8)
    everyone = {
        0: me,
        1: progress(1, 7, "gloo:all_reduce", 7),
        2: progress(2, 7, "gloo:broadcast", None),
        3: progress(3, 0, "none", None),
    }  # rank 3 completed no collective; rank 2 marked no step
    report = stall_report(me, everyone, world_size=5, timeout=300).splitlines()
    assert (
        report[0] == "phalanx: stall: rank 0 has waited 301 s (stall timeout 300 s) in collective #8 (gloo:all_reduce)"
    )
    assert report[1:5] == [
        "  stalled: rank 1 on node1: never called collective #8; last completed #7 (gloo:all_reduce, step 7)",
        "  stalled: rank 2 on node2: never called collective #8; last completed #7 (gloo:broadcast)",
        "  stalled: rank 3 on node3: never called collective #8; last completed #0 (none)",
        "  stalled: rank 4: its watchdog posted no progress (the process may be frozen or gone)",
    ]
    assert report[5].startswith("HINT: ")


def test_a_stall_in_a_group_compares_that_group_s_numbers_among_its_members():
    """Sequence numbers count per process group: rank 1 is far ahead in the default group, yet
    never called #3 of group 1; rank 2 is no member of group 1 and is not named."""
    me = waiting(0, 3, group="1", desc="metrics")
    behind = Progress(rank=1, node="node1", issued={"0": 900, "1": 2}, completed={"0": 900, "1": 2},
                      last_completed_op={"0": "gloo:all_reduce", "1": "gloo:broadcast"}, pending_group=None,
                      pending_group_desc=None, pending_op=None, pending_seq=None, pending_for_s=0.0, step=40)  # fmt: skip
    everyone = {0: me, 1: behind, 2: progress(2, 900, "gloo:all_reduce", 40)}
    report = stall_report(me, everyone, world_size=3, timeout=300, members=frozenset({0, 1})).splitlines()
    assert report[0].endswith("in collective #3 (gloo:all_reduce) of process group 1 (metrics)")
    assert report[1:-1] == [
        "  stalled: rank 1 on node1: never called collective #3; last completed #2 (gloo:broadcast, step 40)"
    ]
    # without the group's members (torch could not say), a rank that called nothing in it is not judged
    assert stall_report(me, everyone, 3, 300).splitlines()[1:-1] == report[1:-1]
    everyone[1] = progress(1, 3, "gloo:all_reduce", 40, group="1")
    assert stall_report(me, everyone, 3, 300, frozenset({0, 1})).splitlines()[1] == (
        "  every rank of the group called collective #3, but it does not complete: a network or backend hang"
    )
    unnamed = waiting(0, 3, group="1", desc="undefined")  # new_group() without a group_desc
    assert stall_report(unnamed, everyone, 3, 300).splitlines()[0].endswith("(gloo:all_reduce) of process group 1")


def test_a_group_whose_entries_left_the_buffer_keeps_its_numbers():
    from phalanx.runtime.watchdog import with_earlier

    earlier = Progress(rank=1, node="n", issued={"0": 400, "1": 2}, completed={"0": 400, "1": 2},
                       last_completed_op={"0": "gloo:all_reduce", "1": "gloo:broadcast"}, pending_group=None,
                       pending_group_desc=None, pending_op=None, pending_seq=None, pending_for_s=0.0, step=3)  # fmt: skip
    now = progress(1, 900, "gloo:all_reduce", 9)  # 500 of group 0 since: group 1's entries are gone
    kept = with_earlier(now, earlier)
    assert kept.issued == {"0": 900, "1": 2} and kept.completed == {"0": 900, "1": 2}
    assert kept.last_completed_op == {"0": "gloo:all_reduce", "1": "gloo:broadcast"} and kept.step == 9
    assert with_earlier(now, None) is now


@pytest.mark.parametrize("status", [None, {}, {"0": {"enqueued": 3}}, {"0": None}])
def test_a_status_of_another_shape_makes_every_poll_read_the_entries(monkeypatch, status):
    """Another torch's dump is stood in for: the watchdog must then work as without the counts."""
    import pickle

    from phalanx.runtime import watchdog

    monkeypatch.setattr(watchdog, "_dump_flight_recorder", lambda *_a, **_k: pickle.dumps({"pg_status": status}))
    assert watchdog.collective_counts("gloo") is None
    assert stood_still(watchdog.collective_counts("gloo"), watchdog.collective_counts("gloo"))


def test_a_stopped_watchdog_lets_go_of_its_store_connection(monkeypatch):
    # a script that forms groups one after another would otherwise keep one connection per group
    store = serve_job_store(monkeypatch)

    def connections() -> int:
        return sum(1 for c in psutil.Process().net_connections("tcp") if c.raddr and c.raddr.port == store.port)

    before = connections()
    watchdog = StallWatchdog(rank=0, world_size=1, stall_timeout=300, backend="gloo", poll_s=0.05)
    watchdog.start()
    assert connections() == before + 1
    watchdog.stop()
    assert connections() == before
