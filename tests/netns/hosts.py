"""Two hosts on one machine, from phalanx's own test bed (phalanx.testbed): network namespaces on
a bridge, each with its own address.

The machine's hostname still resolves to 127.0.0.1 inside them, the trap that real clusters and
containers set for plain torchrun.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from phalanx.testbed import Host, Shaping, test_bed


def skip_unless_namespaces_work() -> None:
    if os.geteuid() != 0:
        pytest.skip("two-host tests need root to create network namespaces (CI runs as root)")
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        pytest.skip("two-host tests need iproute2's `ip` and util-linux's `nsenter`")
    probe = f"phxprobe{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, OSError) as error:
        pytest.skip(f"network namespaces are not available here: {error}")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts(tag: str, rate: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Hosts a and b (their interface is eth0), the link shaped to ``rate``; always removed."""
    skip_unless_namespaces_work()
    with test_bed(f"{tag}{os.getpid() % 100000}", ["a", "b"], shaping=Shaping(rate=rate)) as bed:
        yield bed.hosts[0], bed.hosts[1]
