"""Writes the TCP ports its launcher (the worker's parent) listens on, with their addresses,
and the workers' store port (MASTER_PORT), to OUT.json."""

import json
import os
import sys

import psutil

listening = [c for c in psutil.Process(os.getppid()).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
with open(sys.argv[1], "w") as out:
    json.dump(
        {"listeners": [[c.laddr.ip, c.laddr.port] for c in listening], "master_port": int(os.environ["MASTER_PORT"])},
        out,
    )
