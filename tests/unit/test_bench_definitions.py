"""nccl-tests' definitions, the size walk and the settings refusals of `phalanx bench collectives`."""

from __future__ import annotations

import pytest

from phalanx.bench.collective_settings import CollectiveSettings, parse_collectives, parse_dtype, parse_size
from phalanx.bench.collectives import COLLECTIVES, sizes, unsupported_reason
from phalanx.errors import SettingsRefused


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_bus_factors_are_nccl_tests_formulas(ranks: int) -> None:
    ring = (ranks - 1) / ranks
    expected = {
        "all_reduce": 2 * ring,
        "all_gather": ring,
        "reduce_scatter": ring,
        "broadcast": 1.0,
        "all_to_all": ring,
    }
    assert {name: c.bus_factor(ranks) for name, c in COLLECTIVES.items()} == pytest.approx(expected)


def test_counts_and_algbw_bytes_follow_nccl_tests() -> None:
    # a 1 MiB float row on 4 ranks: 262144 elements in the size
    elements, ranks, element = 262144, 4, 4
    gather = COLLECTIVES["all_gather"].counts(elements, ranks)
    assert (gather.send, gather.recv, gather.param) == (65536, 262144, 65536)
    scatter = COLLECTIVES["reduce_scatter"].counts(elements, ranks)
    assert (scatter.send, scatter.recv, scatter.param) == (262144, 65536, 65536)
    alltoall = COLLECTIVES["all_to_all"].counts(elements, ranks)
    assert (alltoall.send, alltoall.recv, alltoall.param) == (262144, 262144, 65536)
    for name in COLLECTIVES:  # every collective's algbw counts the bytes of the row's size
        counts = COLLECTIVES[name].counts(elements, ranks)
        assert counts.size_bytes(element) == 1024**2
        assert COLLECTIVES[name].algbw_bytes(counts, element, ranks) == 1024**2


def test_sizes_walk_as_nccl_tests() -> None:
    assert sizes(8, 128, 2, 0) == [8, 16, 32, 64, 128]
    assert sizes(1024, 5000, 4, 0) == [1024, 4096]
    assert sizes(100, 400, 1, 150) == [100, 250, 400]


@pytest.mark.parametrize(
    "text, expected",
    [("8", 8), ("1K", 1024), ("64M", 64 * 1024**2), ("1g", 1024**3), ("0.5K", 512), ("16MiB", 16 * 1024**2)],
)
def test_sizes_parse_like_nccl_tests(text: str, expected: int) -> None:
    assert parse_size(text, "-b") == expected


def test_names_accept_nccl_tests_spellings() -> None:
    assert parse_collectives("allreduce,alltoall") == ("all_reduce", "all_to_all")
    assert parse_collectives("all") == tuple(COLLECTIVES)
    assert parse_dtype("fp16") == "half"


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: parse_size("12Q", "-b"), "not a size"),
        (lambda: CollectiveSettings(min_bytes=2048, max_bytes=1024), "larger than -e"),
        (lambda: CollectiveSettings(step_factor=1, step_bytes=0), "neither would grow"),
        (lambda: CollectiveSettings(iters=0), "-n 0"),
        (lambda: CollectiveSettings(average=7), "averaging mode"),
        (lambda: parse_collectives("allgatherv"), "unknown collective allgatherv"),
        (lambda: parse_dtype("complex64"), "not a data type"),
        (lambda: CollectiveSettings(dtype="uint32").check_world("gloo", 2), "gloo cannot move uint32"),
        (lambda: CollectiveSettings(dtype="int8", op="avg").check_world("gloo", 2), "cannot be stored back into int8"),
        (lambda: CollectiveSettings(collectives=("broadcast",), root=2).check_world("gloo", 2), "-r 2"),
    ],
)
def test_refusals_say_what_and_hint(make, fragment: str) -> None:
    with pytest.raises(SettingsRefused) as refused:
        make()
    assert fragment in refused.value.what or fragment in refused.value.why
    assert refused.value.hint


def test_nccl_is_not_refused_what_only_gloo_lacks() -> None:
    assert unsupported_reason("nccl", "all_reduce", "uint32", "sum") is None
    assert unsupported_reason("gloo", "all_gather", "int8", "avg") is None  # no reduction, no average


@pytest.mark.parametrize("per_rank", [16, 256, 4096, 1000])
def test_the_check_data_tells_every_ranks_chunk_apart(per_rank: int) -> None:
    """A collective that put one rank's chunk where another's belongs must count wrong."""
    import torch

    from phalanx.bench.collective_runner import _count_wrong, _pattern

    chunks = [_pattern(rank, rank * per_rank, per_rank, 1, "sum", torch.device("cpu")) for rank in range(8)]
    for rank in range(1, 8):
        wrong = _count_wrong(chunks[0].float(), chunks[rank].double(), "sum", 8)
        assert wrong > 0.6 * per_rank, (rank, wrong)  # about 4 in 5 differ, as for random values


def test_the_check_is_exact_where_the_type_is() -> None:
    import torch

    from phalanx.bench.collective_runner import _count_wrong

    exact = torch.tensor([40.0, 12.0])
    assert _count_wrong(torch.tensor([39.0, 12.0], dtype=torch.bfloat16), exact, "sum", 8) == 1  # one lost contribution
    assert _count_wrong(torch.tensor([40.0, 12.0], dtype=torch.bfloat16), exact, "sum", 8) == 0
    assert (
        _count_wrong(torch.tensor([300 - 256, 12], dtype=torch.int8), torch.tensor([300, 12]), "sum", 8) == 0
    )  # wraps
