"""Several hosts on one Linux machine, for rehearsing and testing multi-node jobs:
``phalanx testbed`` on the command line, :func:`test_bed` in tests."""

from phalanx.testbed.bed import Host, Shaping, TestBed, beds, build, tear_down, test_bed

__all__ = ["Host", "Shaping", "TestBed", "beds", "build", "tear_down", "test_bed"]
