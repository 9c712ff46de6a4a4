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


def test_the_log_gives_each_kill_in_order_with_the_memory_it_held(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,100,36855802579,-;python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0\n"
        "3,101,36855805783,-;Memory cgroup out of memory: Killed process 5405 (python3) total-vm:82116kB, "
        "anon-rss:72192kB, file-rss:6636kB, shmem-rss:0kB, UID:0 pgtables:204kB oom_score_adj:0\n"
        "6,102,36855805790,-;eth0: link up\n"
        "3,103,36900000000,-;Out of memory: Killed process 77 (pt_data_worker) total-vm:1kB, anon-rss:9kB, file-rss:0kB\n"
    )
    assert out_of_memory.killed(kmsg) == [
        (5405, "Memory cgroup out of memory: Killed process 5405 (python3) total-vm:82116kB, anon-rss:72192kB"),
        (77, "Out of memory: Killed process 77 (pt_data_worker) total-vm:1kB, anon-rss:9kB"),
    ]
    assert out_of_memory.killed(tmp_path / "missing") == []
