"""An MLflow tracking server that is down is refused at once (X3, X4).

``log.mlflow = http://...`` naming a server that is down used to wait for MLflow's
own retries (seven, with exponential back-off: 254 s against a closed port) before
the one-line error. The tracker now asks the server once, with a bounded wait
(``SERVER_TIMEOUT_S``), before MLflow is used: the refusal must come within a
generous "does not hang" bound, as one ``error:`` line naming the URL and the wait,
with nothing of the run written (``train``) or changed (``resume``).

Only loopback addresses are used. Negative controls: a server that answers (200 or
404) passes the check, and a local file store still logs a run end to end
(``tests/test_tracking_libraries.py::test_mlflow_holds_the_ledger_params_and_the_evaluations``).
"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import process_server
import pytest
from run_support import TINY, short_texts, write_texts

pytest.importorskip("mlflow")

from exactstep.errors import ConfigError  # noqa: E402
from exactstep.tracking.mlflow_run import SERVER_TIMEOUT_S, check_server  # noqa: E402

HANG_BOUND_S = 30  # far above the check's wait, far below MLflow's retries
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                   "ALL_PROXY")


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This environment without proxies (a loopback URL must be asked directly) and
    without a launcher's variables."""
    drop = set(PROXY_VARIABLES) | {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                   "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_cli(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = process_server.run([sys.executable, "-m", "exactstep", *args], capture_output=True,
                              text=True, timeout=120, env=clean_env(), cwd=cwd)
    return done, time.monotonic() - started


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-2000:]
    return lines[0]


def run_args(source: Path, uri: str) -> list[str]:
    pairs = {**TINY, "data.source": source, "train.steps": 2, "train.threads": 1,
             "log.mlflow": uri}
    return [arg for k, v in pairs.items() for arg in ("--set", f"{k}={v}")]


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_closed_port_is_refused_at_train_within_the_bound(tmp_path: Path) -> None:
    source = write_texts(tmp_path / "docs.jsonl", short_texts(20))
    uri = f"http://127.0.0.1:{closed_port()}"
    done, elapsed = run_cli(["train", "--out", str(tmp_path / "run"), "--no-progress",
                             *run_args(source, uri)], tmp_path)
    line = one_error_line(done)
    assert elapsed < HANG_BOUND_S, f"refused after {elapsed:.0f} s"
    assert f"{uri}/health" in line and f"within {SERVER_TIMEOUT_S:g} s" in line, line
    assert "log.mlflow" in line, line
    left = {p.name for p in (tmp_path / "run").iterdir()} if (tmp_path / "run").exists() else set()
    assert not left & {"manifest.json", "ledger.jsonl", "metrics.jsonl", "checkpoints"}


def test_a_server_down_at_resume_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    """A run whose manifest names an http tracking server (its trackers left out while
    it trained, in this process) is resumed by the real command while the server is
    down: one line within the bound, every file of the run byte for byte the same."""
    import exactstep.run.runner as runner
    from exactstep.config import load_config

    source = write_texts(tmp_path / "docs.jsonl", short_texts(20))
    uri = f"http://127.0.0.1:{closed_port()}"
    pairs = run_args(source, uri)
    cfg = load_config(None, [pairs[i + 1] for i in range(0, len(pairs), 2)]
                      + ["train.progress=false"])
    monkeypatch.setattr(runner, "trackers_for", lambda run, start: [])
    runner.train(cfg, tmp_path / "run", progress=False)
    before = snapshot(tmp_path / "run")
    done, elapsed = run_cli(["resume", str(tmp_path / "run"), "--no-progress"], tmp_path)
    line = one_error_line(done)
    assert elapsed < HANG_BOUND_S, f"refused after {elapsed:.0f} s"
    assert f"{uri}/health" in line, line
    assert snapshot(tmp_path / "run") == before


def test_a_server_that_accepts_but_never_answers_is_refused_after_the_wait() -> None:
    """The bound holds for a silent server too: the connection is accepted by the
    kernel (a listening socket) but no byte ever comes back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(4)
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"did not answer GET .*/health within 0.5 s"):
            check_server(uri, timeout=0.5)
        assert time.monotonic() - started < HANG_BOUND_S


class Answer(http.server.BaseHTTPRequestHandler):
    """200 on ``/health``, 502 under ``/gateway`` (a proxy for a server that is down),
    404 elsewhere (as a server without that page would)."""

    def do_GET(self) -> None:  # noqa: N802 (the library's name)
        code = 200 if self.path == "/health" else 404
        self.send_response(502 if self.path.startswith("/gateway") else code)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def answering_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_negative_control_a_server_that_answers_passes(monkeypatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with answering_server() as uri:
        check_server(uri)  # 200 on /health
        check_server(uri + "/prefix")  # 404: it answered, so it is up
        check_server(uri.replace("http://", "http://user:secret@"))  # credentials kept out
        with pytest.raises(ConfigError, match="HTTP 502"):
            check_server(uri + "/gateway")  # a gateway answering for a server that is down


def test_non_http_uris_are_not_asked(tmp_path: Path) -> None:
    check_server((tmp_path / "store").as_uri())
    check_server(f"sqlite:///{tmp_path / 'db.sqlite'}")
