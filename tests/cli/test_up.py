"""`tsukimi up` and `tsukimi compose` as a user runs them: argument errors exit 2, and a whole run (real nats-server,
stand-in services) comes up, announces its URL once and stops on Ctrl-C with no process left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shared.tools.cli.compose import render_compose
from shared.tools.cli.main import main
from shared.tools.nats_server import NatsServerError, find_nats_server, free_port
from shared.tools.topology import SERVICES

# Stands in for every service: prints its pid and TSUKIMI_* settings; the gateway also answers GET /health with 200.
FAKE_SERVICE = textwrap.dedent("""
    import http.server, json, os, time
    env = {k: v for k, v in os.environ.items() if k.startswith("TSUKIMI_")}
    print(json.dumps({"pid": os.getpid(), **env}), flush=True)
    if env["TSUKIMI_INSTANCE_ID"].startswith("gateway-"):
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # /health counts more live instances of each role than any test starts
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
                self.wfile.write(json.dumps({"status": "ok", "scheduler": 9, "prefill": 9, "decode": 9}).encode())
            def log_message(self, *args):
                pass
        http.server.HTTPServer((env["TSUKIMI_HOST"], int(env["TSUKIMI_PORT"])), Health).serve_forever()
    time.sleep(600)
""")


def exit_code_and_output(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["up", "--prefill", "0"], "must be a positive integer"),
        (["up", "--decode", "x"], "invalid positive_int value"),
        (["up", "--port", "0"], "port must be in 1..65535"),
        (["up", "--startup-timeout", "0"], "--startup-timeout must be positive"),
        (["up", "--model", "/nonexistent/model.gguf"], "no model at /nonexistent/model.gguf"),
        (["compose", "--cache-stores", "0"], "must be a positive integer"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = exit_code_and_output(argv, capsys)
    assert code == 2 and message in err


def test_a_port_in_use_exits_2_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = exit_code_and_output(["up", "--port", str(port)], capsys)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err


def test_an_unknown_tsukimi_variable_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TSUKIMI_PREFIL", "2")
    code, _, err = exit_code_and_output(["up"], capsys)
    assert code == 2 and "TSUKIMI_PREFIL" in err


def test_help_explains_up_and_compose(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = exit_code_and_output(["up", "--help"], capsys)
    assert code == 0 and "usage: tsukimi up" in out
    for text in ("--prefill", "--cache-stores", "--nats-url", "--log-dir", "/health", "Ctrl-C", "TSUKIMI_INSTANCE_ID"):
        assert text in out
    code, out, _ = exit_code_and_output(["compose", "--help"], capsys)
    assert code == 0 and "--output" in out


def test_up_and_the_control_commands_do_not_load_torch() -> None:
    """The supervisor (and compose, secrets, nats, keys) import only their own command: no torch, no model code."""
    probe = ("import sys\nfrom shared.tools.cli.main import main\nfor command in ('up', 'compose', 'secrets', 'nats', "
             "'keys'):\n    try:\n        main([command, '--help'])\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'shared.model.llama', 'shared.engine.engine') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]


def test_compose_prints_or_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compose"]) == 0
    assert capsys.readouterr().out == render_compose()
    assert main(["compose", "--prefill", "2", "--output", str(tmp_path / "dc.yml")]) == 0
    assert (tmp_path / "dc.yml").read_text() == render_compose(prefill=2)


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def is_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def fake_services(root: Path) -> Path:
    """A `services` package whose modules are FAKE_SERVICE; run from `root`, it shadows the real one."""
    (root / "services").mkdir(parents=True)
    (root / "services" / "__init__.py").write_text("")
    for service in SERVICES:
        (root / "services" / f"{service.module.split('.')[1]}.py").write_text(FAKE_SERVICE)
    return root


def wait_for_text(path: Path, text: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGKILL])
def test_up_runs_every_instance_and_stops_with_no_orphan(tmp_path: Path, stop_signal: signal.Signals) -> None:
    """SIGINT (Ctrl-C): a clean stop, exit 0 within 10 s. SIGKILL: the kernel kills the children (PDEATHSIG)."""
    try:
        find_nats_server()
    except NatsServerError:
        pytest.skip("nats-server is not installed")
    port, logs, out = free_port(), tmp_path / "logs", tmp_path / "out.txt"
    argv = [sys.executable, "-m", "shared", "up", "--prefill", "2", "--cache-stores", "2", "--port", str(port),
            "--log-dir", str(logs), "--startup-timeout", "30"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSUKIMI_")}
    with open(out, "w") as stdout:
        up = subprocess.Popen(argv, cwd=fake_services(tmp_path / "fake"), env=env, stdout=stdout, stderr=stdout)
    try:
        assert wait_for_text(out, "tsukimi is up:", 30), out.read_text()
        assert f"tsukimi is up: http://127.0.0.1:{port}/v1  (OpenAI-compatible; Ctrl-C to stop)" in out.read_text()
        instances = {"gateway-0", "scheduler-0", "prefill-0", "prefill-1", "decode-0", "cache-store-0", "cache-store-1"}
        for name in instances:
            assert wait_for_text(logs / f"{name}.log", '"pid"', 10), name
        reports = {n: json.loads((logs / f"{n}.log").read_text().splitlines()[-1]) for n in instances}
        assert all(r["TSUKIMI_INSTANCE_ID"] == n and r["TSUKIMI_CACHE_SHARDS"] == "2" for n, r in reports.items())
        assert [reports[f"cache-store-{i}"]["TSUKIMI_CACHE_SHARD"] for i in (0, 1)] == ["0", "1"]
        nats_port = int(reports["prefill-1"]["TSUKIMI_NATS_URL"].rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", nats_port), timeout=2).close()  # the embedded nats-server
        children = children_of(up.pid)
        assert len(children) == len(instances) + 1  # and nats-server
        assert "exited" not in out.read_text()  # no child died and was restarted
        up.send_signal(stop_signal)
        assert up.wait(timeout=10) == (0 if stop_signal == signal.SIGINT else -signal.SIGKILL), out.read_text()
        assert out.read_text().count("tsukimi is up:") == 1
        deadline = time.monotonic() + 3
        while [pid for pid in children if is_alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in children if is_alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
