"""A data-parallel replica exits when its front is killed outright (fleet/front_watch.py): a
stand-in front starts a stand-in replica the way replicas.py does (its own session, the front's
pid in JAXSERVE_FRONT_PID) and is SIGKILLed; the replica must be gone soon after. No jax is
imported by either process (jaxserve's package is lazy), so this takes a few seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxserve.fleet.front_watch import FRONT_PID_ENV, exit_with_front, front_environment

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

_REPLICA = textwrap.dedent(
    """
    import time
    from jaxserve.fleet.front_watch import exit_with_front
    exit_with_front(interval_s=0.05)
    print("ready", flush=True)
    time.sleep(120)
    """
)
_FRONT = textwrap.dedent(
    f"""
    import os, subprocess, sys
    from jaxserve.fleet.front_watch import front_environment
    env = {{**os.environ, **front_environment()}}
    child = subprocess.Popen([sys.executable, "-c", {_REPLICA!r}], env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    import time; time.sleep(120)
    """
)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_replica_exits_when_its_front_is_killed():
    front = subprocess.Popen([sys.executable, "-c", _FRONT], stdout=subprocess.PIPE, text=True)
    replica = None
    try:
        replica = int(front.stdout.readline())
        time.sleep(0.3)  # six of the replica's polls
        assert not _gone(replica), "the replica exited while its front was there"
        front.send_signal(signal.SIGKILL)
        front.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(replica) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(replica), "the replica outlived its front"
    finally:
        front.kill()
        if replica is not None and not _gone(replica):
            os.kill(replica, signal.SIGKILL)


def test_no_front_named_no_watch_and_bad_values_refused():
    assert exit_with_front({}) is None
    assert front_environment(1234) == {FRONT_PID_ENV: "1234"}
    with pytest.raises(ValueError, match="JAXSERVE_FRONT_PID='abc' is not a process id"):
        exit_with_front({FRONT_PID_ENV: "abc"})
    with pytest.raises(ValueError, match="must be > 1"):
        exit_with_front({FRONT_PID_ENV: "1"})
