"""Reading the kernel's count and log of out-of-memory kills (the kills themselves are real in
tests/e2e/test_out_of_memory.py); here, files in the kernel's formats."""

from __future__ import annotations

from phalanx.launch import out_of_memory


def test_the_count_is_read_from_vmstat_and_unknown_without_it(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 5000\noom_kill 3\noom_kill_extra 9\n")
    assert out_of_memory.kills(vmstat) == 3
    vmstat.write_text("nr_free_pages 5000\n")  # a kernel before 4.13
    assert out_of_memory.kills(vmstat) is None
    assert out_of_memory.kills(tmp_path / "missing") is None


KILL = "3,{seq},1,-;Memory cgroup out of memory: Killed process {pid} (python3) total-vm:8kB, anon-rss:72kB, file-rss:6kB\n"


def test_a_kill_counts_from_the_watchs_start_and_names_the_pid_it_killed(tmp_path):
    vmstat, kmsg = tmp_path / "vmstat", tmp_path / "kmsg"
    vmstat.write_text("oom_kill 1\n")
    kmsg.write_text(KILL.format(seq=1, pid=700))  # before the watch: not one of its kills
    watch = out_of_memory.OomWatch(vmstat, kmsg)
    try:
        assert watch.explain(700, -9) == ""  # the count has not moved
        with kmsg.open("a") as log:
            log.write("6,2,2,-;eth0: link up\n" + KILL.format(seq=3, pid=800) + KILL.format(seq=4, pid=900))
        vmstat.write_text("oom_kill 3\n")
        assert watch.explain(800, -9) == (
            "the kernel's out-of-memory killer ended it: Memory cgroup out of memory: Killed process 800 (python3) "
            "total-vm:8kB, anon-rss:72kB"
        )
        dataloader = ("RuntimeError: DataLoader worker (pid(s) 900) exited unexpectedly",)
        assert watch.explain(801, 1, dataloader).startswith("the kernel's out-of-memory killer ended its process 900:")
        assert watch.explain(700, 1) == ""  # an exit of its own, and its pid was killed before the watch
        # A SIGKILL that no line names (another pid namespace's pids): the count, and the last line
        assert watch.explain(802, -9) == (
            "most likely the kernel's out-of-memory killer: it ended 2 processes on this machine meanwhile; the "
            "kernel's log: Memory cgroup out of memory: Killed process 900 (python3) total-vm:8kB, anon-rss:72kB"
        )
    finally:
        watch.close()


def test_without_the_kernels_log_the_count_is_all_there_is(tmp_path):
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("oom_kill 0\n")
    watch = out_of_memory.OomWatch(vmstat, tmp_path / "no-kmsg")
    vmstat.write_text("oom_kill 1\n")
    assert watch.explain(5, -9) == (
        "most likely the kernel's out-of-memory killer: it ended 1 process on this machine meanwhile"
    )
    assert watch.explain(5, 1) == ""  # not a SIGKILL: nothing says the killer was there
    assert out_of_memory.OomWatch(tmp_path / "no-vmstat").explain(5, -9) == ""
