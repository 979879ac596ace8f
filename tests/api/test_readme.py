"""The README's client examples run as written (only the port differs) against the demo server."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, start_server, stop_server


def readme_blocks(lang):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


@pytest.fixture(scope="module")
def open_server(model_dir):
    # As the README starts it: no key, any model name.
    srv = start_server(model_dir, tag="readme", strict=False, auth=False,
                       extra=["--request-defaults", '{"logit_bias": {"1": 12}}'])
    yield srv
    stop_server(srv)


def test_python_examples(open_server):
    blocks = [b for b in readme_blocks("python") if "127.0.0.1:8000" in b]
    assert blocks
    port = open_server.base.rsplit(":", 1)[1]
    for b in blocks:
        p = subprocess.run([sys.executable, "-c", b.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr


def test_curl_examples(open_server):
    if not subprocess.run(["which", "curl"], capture_output=True).returncode == 0:
        pytest.skip("no curl")
    port = open_server.base.rsplit(":", 1)[1]
    cmds = [b for b in readme_blocks("sh") if b.lstrip().startswith("curl")]
    assert cmds
    for c in cmds:
        p = subprocess.run(["sh", "-c", c.strip().replace("localhost:8000", f"localhost:{port}") + " --fail"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and '"choices"' in p.stdout, (p.stdout, p.stderr)
