"""Starts `dsv4 serve` on the demo model (loopback only) for the API tests."""
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("DSV4_BIN", os.path.join(ROOT, "target", "release", "dsv4"))
API_KEY = "test-key"
MODEL = "dsv4-test"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base, proc, model_dir, log_path):
        self.base = base
        self.proc = proc
        self.model_dir = model_dir
        self.log_path = log_path

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def url(self, path):
        return self.base + path

    def metrics(self):
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                k, v = line.split()
                out[k] = float(v)
        return out


def start_server(model_dir, extra=(), tag="server", strict=True, auth=True):
    """Starts `dsv4 serve` and waits for /health; returns a Server. `strict`: unknown model
    names get 404 (the hostile-request tests rely on it; agents' own names are tested apart)."""
    port = free_port()
    log = open(os.path.join(os.path.dirname(model_dir), f"{tag}-{port}.log"), "w")
    # Defaults that `extra` may override.
    defaults = [a for k, v in (("--max-seqs", "8"), ("--max-context", "4096"), ("--max-body-mb", "1"))
                if k not in extra for a in (k, v)]
    proc = subprocess.Popen(
        [BIN, "serve", "--model", model_dir, "--port", str(port), *(["--api-key", API_KEY] if auth else []),
         "--served-model-name", MODEL, *defaults, *(["--strict-model-name"] if strict else []), *extra],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if json.loads(r.read())["status"] == "ok":
                    break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("dsv4 serve exited; see " + log.name)
            time.sleep(0.1)
    else:
        raise RuntimeError("dsv4 serve did not come up")
    return Server(base, proc, model_dir, log.name)


def stop_server(srv, sig=None):
    """Stops a server; SIGINT is the graceful stop that persists the KV cache."""
    import signal
    srv.proc.send_signal(sig or signal.SIGTERM)
    try:
        srv.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


@pytest.fixture(scope="session")
def model_dir():
    tmp = tempfile.mkdtemp(prefix="dsv4-api-")
    d = os.path.join(tmp, "tiny")
    subprocess.run([BIN, "init-tiny", "--out", d, "--seed", "1"], check=True)
    return d


@pytest.fixture(scope="session")
def server(model_dir):
    srv = start_server(model_dir)
    yield srv
    stop_server(srv)
