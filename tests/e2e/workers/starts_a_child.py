"""Starts a child process (`sleep` with the tag given) that would outlive it, writes the child's
pid to READY, then ends at once, or with --hold waits to be killed."""

import subprocess
import sys
import time
from pathlib import Path

tag, ready = sys.argv[1], Path(sys.argv[2])
child = subprocess.Popen(["sleep", tag])
ready.write_text(str(child.pid))
if "--hold" in sys.argv:
    time.sleep(300)
