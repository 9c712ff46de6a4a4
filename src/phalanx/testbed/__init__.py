"""Several hosts on one Linux machine, for rehearsing and testing multi-node jobs:
``phalanx testbed`` on the command line, :func:`test_bed` in tests."""

from phalanx.testbed.bed import Host, Shaping, TestBed, beds, build, check_can_build, tear_down, test_bed
from phalanx.testbed.together import Outcome, phalanx_argv, run_together

__all__ = [
    "Host",
    "Outcome",
    "Shaping",
    "TestBed",
    "beds",
    "build",
    "check_can_build",
    "phalanx_argv",
    "run_together",
    "tear_down",
    "test_bed",
]
