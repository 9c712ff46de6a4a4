"""`phalanx bench collectives` as real gloo jobs: the numbers obey nccl-tests' definitions."""

from __future__ import annotations

import json

import pytest

from phalanx.bench.collectives import COLLECTIVES

SMALL = ("--collective", "all", "-b", "1K", "-e", "64K", "-f", "4", "-n", "3", "-w", "1")


def check_definitions(report: dict, ranks: int) -> None:
    assert report["world_size"] == ranks
    assert [r["collective"] for r in report["results"]] == list(COLLECTIVES)
    for result in report["results"]:
        collective = COLLECTIVES[result["collective"]]
        assert [row["size_bytes"] for row in result["rows"]] == [1024, 4096, 16384, 65536]
        cells = []
        for row in result["rows"]:
            counts = collective.counts(row["size_bytes"] // 4, ranks)
            assert row["count"] == counts.param
            for variant, allowed in (("out_of_place", collective.out_of_place), ("in_place", collective.in_place)):
                cell = row[variant]
                assert (cell is not None) == allowed, (result["collective"], variant)
                if cell is None:
                    continue
                cells.append(cell["busbw"])
                moved = collective.algbw_bytes(counts, 4, ranks)
                assert cell["algbw"] == pytest.approx(moved / (cell["time_us"] * 1e-6) / 1e9, rel=1e-9)
                assert cell["busbw"] / cell["algbw"] == pytest.approx(collective.bus_factor(ranks), rel=1e-12)
                assert cell["wrong"] == 0
        assert result["wrong"] == 0
        assert result["avg_busbw"] == pytest.approx(sum(cells) / len(cells), rel=1e-12)


@pytest.mark.parametrize(
    "layout, ranks", [(("--nproc-per-node", "2"), 2), (("--simulate-nodes", "2", "--nproc-per-node", "2"), 4)]
)
def test_every_collective_obeys_the_definitions(phalanx, layout, ranks: int) -> None:
    done = phalanx("bench", "collectives", *layout, *SMALL, "--json", timeout=240)
    assert done.returncode == 0, done.output
    report = json.loads(done.stdout)
    check_definitions(report, ranks)
    assert len({rank["node"] for rank in report["ranks"]}) == report["nodes"] == (2 if ranks == 4 else 1)


def test_a_corrupted_result_is_counted_wrong_and_fails(phalanx, workdir) -> None:
    plot = workdir / "busbw.png"
    done = phalanx("bench", "collectives", "--simulate-nodes", "2", "--collective", "all_reduce,all_gather", "-b", "4K",
                   "-e", "16K", "-n", "2", "--corrupt", "2", "--plot", str(plot), "--line-rate", "1gbit", timeout=180)  # fmt: skip
    assert done.returncode == 1, done.output
    lines = done.stdout.splitlines()
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert len(rows) == 4  # 4K and 16K, two collectives
    assert [row[-1] for row in rows] == ["2"] * 4  # in-place #wrong: rank 0's two altered elements
    assert [row[8] for row in rows[2:]] == ["2", "2"]  # all_gather's out-of-place #wrong too
    assert [row[5] for row in rows[:2]] == ["n/a", "n/a"]  # torch has no out-of-place all_reduce
    footers = [line for line in lines if line.startswith("# Out of bounds values")]
    assert footers == ["# Out of bounds values : 2 FAILED", "# Out of bounds values : 4 FAILED"]  # cells, as nccl-tests
    assert "# line rate of the link: 1 Gbit/s = 0.125 GB/s (lo)" in lines
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refused_before_anything_starts(phalanx, workdir) -> None:
    done = phalanx("bench", "collectives", "--nproc-per-node", "2", "-d", "uint32", timeout=60)
    assert done.returncode == 2
    assert "gloo cannot move uint32" in done.stderr and "HINT: use -d int32" in done.stderr
    assert "rank table" not in done.stderr  # no job was started
    done = phalanx("bench", "collectives", "--plot", str(workdir / "missing" / "x.png"), timeout=60)
    assert done.returncode == 2 and "does not exist" in done.stderr
