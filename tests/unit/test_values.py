import pytest

from phalanx.settings.values import (
    Endpoint,
    InvalidValue,
    NodeRange,
    parse_backend,
    parse_endpoint,
    parse_nnodes,
    parse_nproc_per_node,
    parse_seconds,
)


@pytest.mark.parametrize(
    "text, expected",
    [("2", NodeRange(2, 2)), ("1:4", NodeRange(1, 4)), (" 3 ", NodeRange(3, 3)), (8, NodeRange(8, 8))],
)
def test_nnodes_accepts_counts_and_ranges(text, expected):
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize(
    "text, says",
    [
        ("0", "at least 1"),
        ("4:2", "larger than the maximum"),
        ("a", "neither"),
        ("1:2:3", "neither"),
        ("-1", "neither"),
    ],
)
def test_nnodes_refuses_with_reason_and_hint(text, says):
    with pytest.raises(InvalidValue) as refused:
        parse_nnodes(text)
    assert says in refused.value.why
    assert "MIN:MAX" in refused.value.hint


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10.0.0.1:29500", Endpoint("10.0.0.1", 29500)),
        ("10.0.0.1", Endpoint("10.0.0.1", 29400)),
        ("node-1.cluster", Endpoint("node-1.cluster", 29400)),
        ("[fd00::1]:1234", Endpoint("fd00::1", 1234)),
        ("fd00::1", Endpoint("fd00::1", 29400)),
    ],
)
def test_endpoint_parses_host_and_port(text, expected):
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    "text, says",
    [
        ("10.0.0.1:0", "from 1 to 65535"),
        ("10.0.0.1:70000", "from 1 to 65535"),
        ("10.0.0.1:http", "not a number"),
        ("bad host:1", "not a host name"),
        ("999.1.1.1:1", "not a host name"),
        ("", "empty"),
        ("[fd00::1:1", "not closed"),
    ],
)
def test_endpoint_refuses_malformed(text, says):
    with pytest.raises(InvalidValue) as refused:
        parse_endpoint(text)
    assert says in refused.value.why
    assert "HOST[:PORT]" in refused.value.hint


def test_nproc_per_node_keywords_and_numbers():
    assert parse_nproc_per_node("auto") == "auto"
    assert parse_nproc_per_node("GPU") == "gpu"
    assert parse_nproc_per_node("4") == 4
    with pytest.raises(InvalidValue, match="a node runs at least 1 worker process"):
        parse_nproc_per_node("0")
    with pytest.raises(InvalidValue, match="not a number of processes"):
        parse_nproc_per_node("many")


def test_backend_and_seconds():
    assert parse_backend("NCCL") == "nccl"
    with pytest.raises(InvalidValue, match="not a backend"):
        parse_backend("mpi")
    assert parse_seconds("2.5", name="--join-timeout") == 2.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        with pytest.raises(InvalidValue):
            parse_seconds(bad, name="--join-timeout")
