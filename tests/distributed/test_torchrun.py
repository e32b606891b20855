"""Two "nodes" on this machine: two ``torchrun --nnodes 2`` launches, one process each, that
together serve one model tensor-parallel over gloo. Node 0's process (global rank 0) runs the
engine and the OpenAI server; node 1's runs the worker loop. Queried over HTTP, checked against
a single-process ``LLM``; a SIGTERM to the server stops both nodes cleanly."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO
from tests.distributed.test_server_tp import PROMPT, child_pids
from tests.server.conftest import GREEDY, MODEL, TOKENIZER

TORCHRUN = Path(sys.executable).parent / "torchrun"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node(rank: int, port: int) -> subprocess.Popen[str]:
    """``torchrun`` for node ``rank`` of 2 (one process) running ``foudre serve``."""
    cmd = [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           "-m", "foudre.cli", "serve", "--model", str(MODEL), "--tokenizer", str(TOKENIZER),
           "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def ready_url(proc: subprocess.Popen[str], timeout: float = 120.0) -> tuple[str, list[str]]:
    """The URL in the server's ready line on ``proc``'s output, and the lines before it."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                lines.append(line)
                if "foudre: serving" in line:
                    return line.split(" at ", 1)[1].split(" ", 1)[0], lines
        raise AssertionError(f"node 0 did not serve (rc={proc.poll()}):\n{''.join(lines)}")
    finally:
        sel.close()


@pytest.mark.slow
def test_two_nodes_serve_one_model() -> None:
    if not MODEL.exists():
        pytest.skip("../shared/models/stories260K is not present")
    if not TORCHRUN.exists():
        pytest.skip(f"{TORCHRUN} is not installed")
    from foudre import LLM, SamplingParams

    port = free_port()
    nodes = [node(0, port), node(1, port)]
    try:
        url, _ = ready_url(nodes[0])
        assert nodes[1].poll() is None, "node 1 exited while node 0 serves"
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        llm = LLM(str(MODEL), tokenizer=str(TOKENIZER), dtype="float32")
        params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
        expected = llm.generate(PROMPT, params)[0].outputs[0]
        assert choice["text"] == expected.text
        assert choice["text"].startswith(GREEDY[:40])
        assert expected.logprobs is not None
        theirs = [step[t] for step, t in zip(expected.logprobs, expected.token_ids, strict=True)]
        ours = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3

        # SIGTERM to the server (node 0's rank): it shuts down, the worker on node 1 is told
        # to stop, and both torchrun agents exit 0
        (server,) = [
            pid
            for pid in child_pids(nodes[0].pid)
            if b"foudre.cli" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        os.kill(server, signal.SIGTERM)
        for proc in nodes:
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0, out
    finally:
        for proc in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


def test_world_size_that_does_not_match_is_refused() -> None:
    """``T x P`` must be torchrun's world size: the ranks say so and exit, none waits."""
    if not MODEL.exists():
        pytest.skip("../shared/models/stories260K is not present")
    if not TORCHRUN.exists():
        pytest.skip(f"{TORCHRUN} is not installed")
    cmd = [str(TORCHRUN), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "foudre.cli", "serve", "--model", str(MODEL),
           "--tokenizer", str(TOKENIZER), "--tensor-parallel-size", "4", "--port", "0"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=90, check=False
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("foudre: error:")]
    # one per rank that gets to say it: torchrun stops the other rank once one has failed,
    # sometimes before that one has printed (a race on a loaded host); none waits for the other
    assert 1 <= len(errors) <= 2, done.stderr
    assert all("tensor_parallel_size" in line and "4" in line for line in errors), errors
