"""How long this machine takes to look up an address's name the way torch's store client does.

c10d's TCPStore client looks up the name of its own socket's address when a process first
connects, in its IPv4-mapped form (``::ffff:10.0.0.2``), which /etc/hosts never lists: the name
server is asked. Where that server does not answer, glibc waits out its timeout (5 s, twice, by
default) in every agent and worker of the job before its first store request.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

#: Slower than this, a lookup waited out a name server's timeout: one that answers takes milliseconds.
SLOW_S = 0.5
#: The longest the probe waits; a lookup still running then counts as this long.
LIMIT_S = 3.0
#: Lookups made at once, as a node's agent and workers connect together (some name servers drop
#: queries that come together).
AT_ONCE = 4

WHY = (
    "torch's store client looks up the name of its own address before its first request (in the IPv4-mapped "
    "form, which /etc/hosts never lists, so the name server is asked): every agent and worker of a job waits "
    "that long when it connects, and c10d warns 'The hostname of the client socket cannot be retrieved. err=-3'."
)
HINT = (
    "make the name server in /etc/resolv.conf answer, or shorten its wait there (options timeout:1 attempts:1); "
    "with every node's name in /etc/hosts, `hosts: files` in /etc/nsswitch.conf leaves the name server out"
)


def lookup_s(address: str = "127.0.0.1", *, limit_s: float = LIMIT_S) -> float:
    """Seconds the slowest of :data:`AT_ONCE` simultaneous lookups of ``address``'s name takes,
    asked as torch's store client asks it; ``limit_s`` when one is still waiting then.

    Args:
        address: the address whose name is looked up: the one this node connects from.
        limit_s: the most seconds to wait (a lookup cannot be cancelled: its thread is left to end).

    Returns:
        The seconds, at most ``limit_s``. Milliseconds where the name server answers or none is
        configured; the resolver's timeout where one is configured but silent.

    Example:
        >>> lookup_s("127.0.0.1") <= LIMIT_S
        True
    """
    parsed = ipaddress.ip_address(address)
    mapped = f"::ffff:{parsed}" if parsed.version == 4 else str(parsed)
    took: list[float] = []

    def look_up() -> None:
        started = time.monotonic()
        try:
            socket.getnameinfo((mapped, 0), socket.NI_NUMERICSERV)
        except OSError:  # no name, or the name server's timeout: either way the time is the fact
            pass
        took.append(time.monotonic() - started)

    threads = [threading.Thread(target=look_up, name="phalanx-name-lookup", daemon=True) for _ in range(AT_ONCE)]
    deadline = time.monotonic() + limit_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return limit_s if len(took) < len(threads) else min(max(took), limit_s)


def slow_text(seconds: float) -> str:
    """``looking up an address's name takes 5.0 s here`` (``at least`` at the probe's limit)."""
    bound = "at least " if seconds >= LIMIT_S else ""
    return f"looking up an address's name takes {bound}{seconds:.1f} s here: the name server does not answer"
