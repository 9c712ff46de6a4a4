"""Choosing and wording the root cause among the failures torchrun reports."""

import os
import signal
from dataclasses import replace

import pytest

from phalanx.launch.failure import (
    RankFailure,
    ended_before,
    exit_code_for,
    format_root_cause,
    log_lines,
    phalanx_error_in,
    phalanx_error_of,
    root_cause,
    tail_of,
)
from phalanx.launch.group_record import GROUP_RECORD_NAME, GroupRecord


def failure(rank, time, exitcode=1, tail=("Traceback (most recent call last):", "ValueError: x"), reported=100.0):
    """As failures_from makes it; here the log is its tail."""
    error = phalanx_error_in(list(tail))
    return RankFailure(rank, rank % 2, f"node{rank // 2}", f"127.0.0.{101 + rank // 2}", exitcode, time, f"r{rank}.log",
                       tail, reported, error.message if error else (), error.exit_code if error else 1)  # fmt: skip


def test_the_log_that_went_quiet_first_is_the_cause():
    found = [failure(0, 10.5), failure(3, 10.2), failure(1, 10.9)]
    assert root_cause(found).rank == 3


def test_a_rank_its_agent_terminated_is_never_the_cause():
    found = [failure(2, 1.0, exitcode=-signal.SIGTERM), failure(3, 5.0)]
    assert root_cause(found).rank == 3
    text = format_root_cause(found)
    assert text.startswith("phalanx: root cause: rank 3 (local rank 1) on node1 (127.0.0.102) exited with code 1")
    assert "stopped by their agent: rank 2" in text


@pytest.mark.parametrize("last_words", ["terminate called without an active exception",
                                        "terminate called after throwing an instance of 'std::system_error'\n"
                                        "  what():  Resource deadlock avoided"])  # fmt: skip
def test_signals_are_named_and_known_endings_get_a_hint(last_words):
    text = format_root_cause([failure(0, 1.0, exitcode=-6, tail=tuple(last_words.splitlines()))])
    assert "was killed by SIGABRT" in text
    assert "HINT: the worker aborted while tearing its process group down" in text and "context.close()" in text


@pytest.mark.parametrize("last_words", [
    "Traceback (most recent call last):\n"
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \n"
    "Last error:\n"
    "Error while creating shared memory segment /dev/shm/nccl-ZcT1bK (size 9637888), error: No space left on device "
    "(28)",
    "Traceback (most recent call last):\n"
    "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's "
    "workers are out of shared memory. Please try to raise your shared memory limit.",
])  # fmt: skip
def test_shared_memory_that_ran_out_gets_the_shm_remedy(last_words):
    """NCCL's words as torch's exception quotes them (no GPU here: the text is NCCL's and torch's),
    and the DataLoader's where memory in /dev/shm is written before it is reserved; the DataLoader's
    own ENOSPC runs for real in tests/e2e/test_out_of_memory.py."""
    text = format_root_cause([failure(0, 1.0, tail=tuple(last_words.splitlines()))])
    assert "HINT: /dev/shm on that node is full or too small" in text and "--shm-size=16g" in text


def test_tail_starts_at_the_last_traceback(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text(
        "noise\nTraceback (most recent call last):\n  old\nTraceback (most recent call last):\n  new\nKeyError: 1\n"
    )
    assert tail_of(log_lines(log)) == ("Traceback (most recent call last):", "  new", "KeyError: 1")
    assert tail_of(log_lines(tmp_path / "missing.log")) == ()


def test_a_stall_report_is_kept_from_its_first_line():
    report = ["phalanx: stall: rank 0 has waited 9 s in collective #4", *[f"  stalled: rank {r}" for r in range(1, 20)]]
    assert tail_of(["Traceback (most recent call last):", "KeyError: 1", *report]) == tuple(report[:12])


def test_preemption_is_told_apart_from_a_failure():
    from phalanx.launch.failure import is_preemption

    assert is_preemption([failure(1, 1.0, exitcode=75), failure(0, 1.1, exitcode=-signal.SIGTERM)])
    assert not is_preemption([failure(0, 1.0, exitcode=-signal.SIGTERM)])
    assert not is_preemption([failure(1, 1.0, exitcode=75), failure(0, 1.1, exitcode=1)])


REFUSED_TAIL = (
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "train.py", line 298, in main',
    "[rank1]:     raise SettingsRefused(",
    "[rank1]: phalanx.errors.SettingsRefused: phalanx: error: compression bf16 on the gloo backend (cpu)",
    "[rank1]:   gloo cannot reduce bf16 gradients.",
    "[rank1]: HINT: use --compression fp16",
    "[W1202 04:52:28 ProcessGroup.cpp] destroy_process_group() was not called",
)


def test_a_phalanx_error_in_a_worker_is_shown_as_its_message_with_its_exit_code():
    found = [failure(1, 1.0, tail=REFUSED_TAIL), failure(0, 1.2, tail=REFUSED_TAIL), failure(2, 1.5)]
    ending = phalanx_error_of(found[0])
    assert ending.is_refusal and ending.message == (
        "phalanx: error: compression bf16 on the gloo backend (cpu)", "  gloo cannot reduce bf16 gradients.",
        "HINT: use --compression fp16",
    )  # fmt: skip
    assert exit_code_for(found) == 2  # SettingsRefused: ExitCode.REFUSED
    text = format_root_cause(found)
    assert text.splitlines()[0] == ("phalanx: root cause: rank 1 (local rank 1) on node0 (127.0.0.101) exited with code 1: "
                                    "it refused its settings (traceback: r1.log)")  # fmt: skip
    assert "  refused too: rank 0" in text and "  then failed too: rank 2" in text
    assert text.endswith("phalanx: error: compression bf16 on the gloo backend (cpu)\n  gloo cannot reduce bf16 "
                         "gradients.\nHINT: use --compression fp16")  # fmt: skip
    assert "Traceback" not in text and "destroy_process_group" not in text


def test_only_refusals_and_preemption_are_not_restarted():
    from phalanx.launch.failure import restart_cannot_help

    refused = [failure(1, 1.0, tail=REFUSED_TAIL), failure(0, 1.2, tail=REFUSED_TAIL)]
    assert restart_cannot_help(refused) == "ranks 0, 1 refused their settings; a restart would refuse them again"
    # the other rank was still running when the agent looked, then stopped by it: still a refusal
    assert restart_cannot_help([failure(1, 1.0, tail=REFUSED_TAIL), failure(0, 1.2, exitcode=-signal.SIGTERM)]) == (
        "rank 1 refused its settings; a restart would refuse them again"
    )
    # a crash while handling the refusal: the crash ended the worker, and a restart may mend it
    crashed_handling = (*REFUSED_TAIL, "", "During handling of the above exception, another exception occurred:", "",
                        "[rank1]: Traceback (most recent call last):", "[rank1]: RuntimeError: CUDA error")  # fmt: skip
    assert restart_cannot_help([failure(1, 1.0, tail=crashed_handling)]) is None
    assert "preemption" in restart_cannot_help(
        [failure(1, 1.0, exitcode=75), failure(0, 1.1, exitcode=-signal.SIGTERM)]
    )
    # one still saving when the agent's grace period ended, SIGKILLed 30 s after the first stop was seen
    late = [failure(1, 1.0, exitcode=75, reported=100.0), failure(0, 1.1, exitcode=-signal.SIGKILL, reported=131.0)]
    assert "preemption" in restart_cannot_help(late)
    assert restart_cannot_help([failure(0, 1.0)]) is None  # a crash: a restart may mend it
    assert restart_cannot_help([failure(1, 1.0, tail=REFUSED_TAIL), failure(0, 1.2)]) is None  # a crash beside it
    assert restart_cannot_help([failure(0, 1.0, exitcode=-9, tail=REFUSED_TAIL)]) is None  # killed, not refused
    assert restart_cannot_help([failure(0, 1.0, exitcode=4, tail=("phalanx: stall: rank 0 has waited 9 s",))]) is None
    assert restart_cannot_help([]) is None


def test_a_failure_before_a_restart_is_told_in_one_line():
    from phalanx.launch.failure import in_one_line

    crash = failure(
        1,
        1.0,
        tail=(
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "t.py", line 1',
            "[rank1]: ValueError: x",
            "[W1202 ProcessGroup.cpp] destroy_process_group() was not called",
        ),
    )
    assert (
        in_one_line([crash, failure(0, 2.0, exitcode=-signal.SIGTERM)])
        == "rank 1 exited with code 1: ValueError: x (r1.log)"
    )
    assert in_one_line([failure(1, 1.0, tail=REFUSED_TAIL)]) == (
        "rank 1 exited with code 1: phalanx: error: compression bf16 on the gloo backend (cpu) (r1.log)"
    )
    assert (
        in_one_line([failure(1, 1.0, tail=("no traceback", "  last line"))])
        == "rank 1 exited with code 1: last line (r1.log)"
    )
    stall = failure(0, 1.0, exitcode=4, tail=("phalanx: stall: rank 0 has waited 9 s", "  stalled: rank 1"))
    assert in_one_line([stall]) == "rank 0 exited with code 4: phalanx: stall: rank 0 has waited 9 s (r0.log)"
    killed = failure(2, 1.0, exitcode=-9, tail=())
    assert in_one_line([killed]) == "rank 2 was killed by SIGKILL (r2.log)"
    assert in_one_line([]) == "a worker failed"


def test_each_phalanx_error_keeps_its_own_exit_code():
    def ending(last_line):
        return [failure(0, 1.0, tail=("Traceback (most recent call last):", last_line))]

    assert (
        exit_code_for(ending("phalanx.runtime.consistency.InconsistentRanks: phalanx: error: the ranks disagree")) == 2
    )
    assert exit_code_for(ending("phalanx.errors.PhalanxError: phalanx: error: something failed")) == 1
    assert (
        "exited with code 1: it stopped with a phalanx error (traceback: r0.log)\nphalanx: error: something failed"
        in (format_root_cause(ending("phalanx.errors.PhalanxError: phalanx: error: something failed")))
    )
    # a class this phalanx does not have (the worker runs another version): a plain failure
    assert exit_code_for(ending("phalanx.errors.NoSuchError: phalanx: error: x")) == 1
    assert exit_code_for(ending("ValueError: phalanx: error: not ours")) == 1
    assert exit_code_for([failure(0, 1.0, exitcode=4, tail=("phalanx: stall: rank 0 has waited 9 s",))]) == 4
    assert exit_code_for([failure(0, 1.0, exitcode=4, tail=("sys.exit(4) of the script's own",))]) == 1
    assert exit_code_for([]) == 1


def test_a_phalanx_error_counts_only_when_it_ended_the_worker():
    """Printed, then the worker went on and was killed (or exited with a code of its own)."""
    for exitcode in (-9, 3):
        killed = failure(0, 1.0, exitcode=exitcode, tail=REFUSED_TAIL)
        assert phalanx_error_of(killed) is None and exit_code_for([killed]) == 1
        assert "refused" not in format_root_cause([killed])


def test_the_error_is_found_in_the_whole_log_not_only_its_tail():
    log = ["Traceback (most recent call last):", "phalanx.runtime.consistency.InconsistentRanks: phalanx: error: the ranks disagree",
           *[f"  key {i}: ranks 0: a; ranks 1: b" for i in range(5)], "HINT: build the same model", "",
           *[f"NCCL INFO teardown {i}" for i in range(8)]]  # fmt: skip
    assert "phalanx: error: the ranks disagree" not in "\n".join(tail_of(log))
    error = phalanx_error_in(log)
    assert error.exit_code == 2 and len(error.message) == 7 and error.message[-1] == "HINT: build the same model"


def test_a_worker_the_agent_killed_after_its_grace_period_is_never_the_cause():
    """A rank stuck outside any collective, whose PreemptionGuard catches the agent's SIGTERM, is
    SIGKILLed 30 s later; its log went quiet first, yet the watchdog's report is the cause."""
    stall = ("phalanx: stall: rank 0 has waited 5 s (stall timeout 4 s) in collective #4 (gloo:all_reduce)",
             "  stalled: rank 1 on node0: never called collective #4; last completed #3 (gloo:all_reduce, step 2)")  # fmt: skip
    found = [
        failure(0, 50.0, exitcode=4, tail=stall, reported=100.0),
        failure(1, 10.0, exitcode=-9, tail=(), reported=131.0),
    ]
    assert root_cause(found).rank == 0 and exit_code_for(found) == 4
    assert "  stopped by their agent: rank 1" in format_root_cause(found)
    # killed when the agent first looked (the out-of-memory killer): the cause
    oom = [failure(1, 10.0, exitcode=-9, tail=(), reported=100.0), failure(0, 12.0, reported=101.0)]
    assert root_cause(oom).rank == 1


def test_every_line_of_a_multi_line_why_is_indented_and_read_back_whole():
    from phalanx.runtime.consistency import InconsistentRanks

    error = InconsistentRanks("the ranks disagree", "dataset length: ranks 0: 100; ranks 1: 101\nbackend: ranks 0: gloo; ranks 1: nccl",
                              "build the same model")  # fmt: skip
    rendered = error.render().splitlines()
    assert rendered[1:3] == ["  dataset length: ranks 0: 100; ranks 1: 101", "  backend: ranks 0: gloo; ranks 1: nccl"]
    log = ["Traceback (most recent call last):", f"phalanx.runtime.consistency.InconsistentRanks: {rendered[0]}", *rendered[1:],
           "[W1202 torch teardown]"]  # fmt: skip
    assert phalanx_error_in(log).message == tuple(rendered)


def test_the_error_that_ended_a_worker_is_read_from_its_error_file_not_from_its_log(tmp_path, monkeypatch):
    """The worker's bootstrap writes the exception with torch's ErrorHandler (as @record does) and
    torch's ProcessFailure reads the file back; a phalanx error the log shows, printed and caught,
    did not end the worker."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from phalanx.launch import bootstrap
    from phalanx.launch.failure import failures_from
    from phalanx.runtime.consistency import InconsistentRanks

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    try:
        raise InconsistentRanks(
            "the ranks disagree", "dataset length: ranks 0: 100; ranks 1: 101", "build the same data"
        )
    except InconsistentRanks as error:
        bootstrap._record(error)
    log = tmp_path / "stderr.log"
    log.write_text(
        "Traceback (most recent call last):\nphalanx.errors.SettingsRefused: phalanx: error: printed and caught\n"
        "HINT: not this one\n"
    )
    ended = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(tmp_path / "error.json"))
    [found] = failures_from({3: ended}, {3: log}, "node1", "127.0.0.102")
    assert found.error == (
        "phalanx: error: the ranks disagree",
        "  dataset length: ranks 0: 100; ranks 1: 101",
        "HINT: build the same data",
    )
    assert found.error_code == 2 and exit_code_for([found]) == 2
    # No error file (the worker printed the error, then exited on its own): no phalanx error.
    quiet = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(tmp_path / "none.json"))
    [found] = failures_from({3: quiet}, {3: log}, "node1", "127.0.0.102")
    assert found.error == () and exit_code_for([found]) == 1


def test_only_ranks_that_ended_on_their_own_before_the_failure_are_named(tmp_path):
    attempt = tmp_path / "attempt_0"
    records = {0: (GroupRecord(4, 4), 100.0),  # ended before rank 3 failed: named
               1: (GroupRecord(4, 4, stopped="after step 9; checkpoint saved"), 100.0),  # stopped for a signal
               2: (GroupRecord(4, 4), 300.0)}  # ended after the failure (its agent stopped it)  # fmt: skip
    for rank, (record, written) in records.items():
        (attempt / f"rank{rank}").mkdir(parents=True)
        record.write(attempt / f"rank{rank}" / GROUP_RECORD_NAME)
        os.utime(attempt / f"rank{rank}" / GROUP_RECORD_NAME, (written, written))
    (attempt / "rank3").mkdir()
    lost_peer = (
        "Traceback (most recent call last):",
        "RuntimeError: [pair.cc:553] Connection closed by peer [1.2.3.4]:5",
    )
    cause = replace(failure(3, 200.0, tail=lost_peer), log=str(attempt / "rank3" / "stderr.log"))
    assert ended_before(cause, [cause]) == [0]
    assert ended_before(cause, [cause, failure(0, 250.0)]) == []  # a rank that failed is no early end
    assert "\n  before it, rank 0 had ended on its own while the others" in format_root_cause([cause])
    # a failure of the rank's own (no lost peer): the ranks that had finished are not to blame
    assert ended_before(replace(cause, tail=("ValueError: in rank 3's own evaluation",)), [cause]) == []
