"""The supervisor with tiny child commands: backoff schedule, restarts, bounded stop, SIGKILL of a stubborn child, and
no orphan when the supervisor itself is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.tools.supervisor import Backoff, ProcessSpec, Supervisor, log_tail

SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")
CRASHER = (sys.executable, "-S", "-c", "import sys; print('boom', flush=True); sys.exit(1)")
STUBBORN = (
    sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)",
)


def is_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for a reaper counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_backoff_doubles_from_half_a_second_to_ten() -> None:
    backoff, failures, delays = Backoff(), 0, []
    for _ in range(7):
        failures, delay = backoff.after_exit(failures, uptime_s=1.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_backoff_resets_after_a_child_stayed_up() -> None:
    backoff = Backoff()
    assert backoff.after_exit(6, uptime_s=29.9) == (7, 10.0)
    assert backoff.after_exit(6, uptime_s=30.0) == (1, 0.5)


def test_a_crashing_child_is_restarted_with_backoff(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = Supervisor([ProcessSpec("crasher", CRASHER)], tmp_path, say=lines.append, backoff=Backoff(0.05, 0.4, 30))
    sup.start()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        sup.poll()
        time.sleep(0.01)
    sup.stop(grace_s=1.0)
    restarts = sup.restarts()["crasher"]
    # Delays 0.05, 0.1, 0.2, 0.4, 0.4, ... plus start-up: about 5 restarts in 2 s; without backoff it would be dozens.
    assert 3 <= restarts <= 8, restarts
    assert "crasher exited with code 1" in lines[0] and "restarting in 0.05 s" in lines[0] and "| boom" in lines[0]
    assert "restarting in 0.4 s" in lines[-1]
    assert (tmp_path / "crasher.log").read_text().count("boom") >= restarts


def test_stop_terminates_every_child_within_the_bound(tmp_path: Path) -> None:
    specs = [ProcessSpec(f"sleeper-{i}", SLEEPER, {"TSUKIMI_INSTANCE_ID": f"sleeper-{i}"}) for i in range(3)]
    sup = Supervisor(specs, tmp_path, say=lambda line: None)
    sup.start()
    pids = sup.pids()
    assert len(pids) == 3 and all(is_alive(pid) for pid in pids.values())
    started = time.monotonic()
    sup.stop(grace_s=8.0)
    assert time.monotonic() - started < 2.0  # SIGTERM ends a sleeping python at once
    assert not any(is_alive(pid) for pid in pids.values())
    assert sup.pids() == {}
    sup.poll()  # no restart after stop
    assert sup.pids() == {}


def test_a_child_ignoring_sigterm_gets_sigkill(tmp_path: Path) -> None:
    sup = Supervisor([ProcessSpec("stubborn", STUBBORN)], tmp_path, say=lambda line: None)
    sup.start()
    assert wait_until(lambda: log_tail(tmp_path / "stubborn.log", 1) == ["ready"], 5.0)  # SIGTERM is ignored now
    pid = sup.pids()["stubborn"]
    started = time.monotonic()
    sup.stop(grace_s=0.5)
    assert 0.5 <= time.monotonic() - started < 2.0
    assert not is_alive(pid)


def test_children_get_the_spec_env_over_the_base_env(tmp_path: Path) -> None:
    argv = (sys.executable, "-c", "import os; print(os.environ['A'], os.environ['B'], flush=True)")
    sup = Supervisor([ProcessSpec("env", argv, {"B": "spec"})], tmp_path, base_env={"A": "base", "B": "base"})
    sup.start()
    assert wait_until(lambda: log_tail(tmp_path / "env.log", 1) == ["base spec"], 5.0)
    sup.stop(grace_s=1.0)


def test_poll_starts_nothing_before_start(tmp_path: Path) -> None:
    sup = Supervisor([ProcessSpec("sleeper", SLEEPER)], tmp_path, say=lambda line: None)
    sup.poll()
    assert sup.pids() == {}
    sup.start()
    sup.poll()
    assert len(sup.pids()) == 1 and sup.restarts() == {"sleeper": 0}
    sup.stop(grace_s=1.0)


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        Supervisor([ProcessSpec("a", SLEEPER), ProcessSpec("a", SLEEPER)], tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_when_the_supervisor_is_sigkilled(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from shared.tools.supervisor import ProcessSpec, Supervisor
        sup = Supervisor([ProcessSpec(f"s{{i}}", {SLEEPER!r}) for i in range(2)], Path({str(tmp_path)!r}))
        sup.start()
        print(*sup.pids().values(), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(is_alive(pid) for pid in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert wait_until(lambda: not any(is_alive(pid) for pid in pids), 3.0)
    finally:
        parent.kill()
        parent.wait()
