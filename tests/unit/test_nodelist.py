"""SLURM's host list grammar, expanded without scontrol."""

import pytest

from phalanx.clusters.nodelist import MAX_HOSTS, NodelistError, expand_nodelist


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("gpu-[01-03,07],cpu5", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "cpu5"]),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),  # the width of LOW is kept past 9
        ("n[9-11]", ["n9", "n10", "n11"]),  # no padding asked for: none added
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # several groups: their product, first slowest
        ("a[1,3],b,c[001-002]", ["a1", "a3", "b", "c001", "c002"]),
        ("node[5]", ["node5"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_expands_as_scontrol_show_hostnames(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("gpu[01-03", "never closed"),
        ("gpu01-03]", "without its '['"),
        ("gpu[03-01]", "runs backwards"),
        ("gpu[a-b]", "neither a number"),
        ("gpu[]", "neither a number"),
        ("n1,,n2", "empty host name"),
        ("", "empty host name"),
        ("n[1-2[3]]", "inside brackets"),
        ("n 1", "space"),
        (f"n[0-{MAX_HOSTS + 1}]", "more than"),
    ],
)
def test_refuses_what_does_not_parse_and_says_why(text, why):
    with pytest.raises(NodelistError, match=why.replace("[", r"\[")):
        expand_nodelist(text)
