"""What ``phalanx launch`` asks each host before starting anything, run there by its Python.

This file is sent as ``python -c SOURCE MODE REQUEST`` over ssh, so it depends on the standard
library alone and works before phalanx is known to be installed on the host. Each mode prints
one JSON line:

- ``facts {"cwd", "files"}``: Python, phalanx and torch versions, the working folder, the
  SHA-256 of each file, the GPU count, the host's addresses;
- ``listen {"port", "token"}``: binds the rendezvous port on all addresses, says whether it
  could, then answers every connection with the token until its standard input closes;
- ``reach {"candidates", "port", "token"}``: for each candidate address of the first host, the
  route there (interface and source address) and whether a connection to the port gets the
  token back.
"""

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import threading

CONNECT_TIMEOUT_S = 3.0


def _version(distribution):
    try:
        from importlib import metadata

        return metadata.version(distribution)
    except Exception:  # not installed, or metadata unreadable: the same answer for the launcher
        return None


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gpu_count():
    folder = "/proc/driver/nvidia/gpus"
    if os.path.isdir(folder):
        return len(os.listdir(folder))
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def _addresses():
    try:
        listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in listed.stdout.splitlines():
        words = line.split()
        if "inet" in words and words[1] != "lo":
            found.append(words[words.index("inet") + 1].split("/")[0])
    return found


def facts(request):
    answer = {"python": platform.python_version(), "executable": sys.executable, "phalanx": _version("phalanx"),
              "torch": _version("torch"), "gpus": _gpu_count(), "hostname": socket.gethostname(),
              "addresses": _addresses(), "files": {}}  # fmt: skip
    try:
        os.chdir(request["cwd"])
    except OSError as error:
        answer["cwd_error"] = error.strerror or str(error)
        return answer
    for path in request["files"]:
        try:
            answer["files"][path] = _sha256(path)
        except OSError as error:
            answer["files"][path] = "error: " + (error.strerror or str(error))
    return answer


def listen(request):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As torch's TCPStore binds: a port whose last job's connections are in TIME_WAIT is free,
    # one that another program listens on is not.
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", request["port"]))
        server.listen(64)
    except OSError as error:
        print(json.dumps({"error": error.strerror or str(error)}), flush=True)
        return
    print(json.dumps({"listening": True}), flush=True)
    token = (request["token"] + "\n").encode()

    def serve():
        while True:
            connection, _ = server.accept()
            with connection:
                connection.sendall(token)
                connection.settimeout(CONNECT_TIMEOUT_S)
                try:  # the other side closes first: the TIME_WAIT is its own, not the rendezvous port's
                    while connection.recv(64):
                        pass
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    sys.stdin.read()  # until the launcher is done with the port


def _route(address):
    try:
        listed = subprocess.run(["ip", "-o", "route", "get", address], capture_output=True, text=True, timeout=10)
        words = listed.stdout.split()
        if listed.returncode == 0:
            return {"device": words[words.index("dev") + 1] if "dev" in words else None,
                    "source": words[words.index("src") + 1] if "src" in words else None}  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))
        return {"device": None, "source": probe.getsockname()[0]}
    except OSError as error:
        return {"error": error.strerror or str(error)}
    finally:
        probe.close()


def _connect(address, port, token):
    try:
        with socket.create_connection((address, port), timeout=CONNECT_TIMEOUT_S) as connection:
            received = b""
            while not received.endswith(b"\n") and len(received) < 256:
                block = connection.recv(256)
                if not block:
                    break
                received += block
    except TimeoutError:
        return "timed out"
    except OSError as error:
        return (error.strerror or str(error)).lower()
    return "ok" if received.decode(errors="replace").strip() == token else "another program answered"


def reach(request):
    answers = []
    for candidate in request["candidates"]:
        try:
            address = socket.getaddrinfo(candidate, request["port"], socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        except OSError:
            answers.append({"candidate": candidate, "connect": "does not resolve"})
            continue
        answer = {"candidate": candidate, "address": address, "route": _route(address)}
        answer["connect"] = _connect(address, request["port"], request["token"])
        answers.append(answer)
    return {"reach": answers}


def main(argv):
    mode, request = argv[0], json.loads(argv[1])
    if mode == "listen":
        listen(request)
    else:
        print(json.dumps({"facts": facts, "reach": reach}[mode](request)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
