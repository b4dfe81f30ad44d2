"""A Flower federation on this machine: one SuperLink and N SuperNodes as local processes, and
``flwr run`` against it (docs/deployment.md). For trying a spec's Flower app before deploying it,
and for tests/test_flower_deployment.py.

Insecure (no TLS, no SuperNode authentication), every API on 127.0.0.1 only: for one machine.
The processes, their logs and Flower's own files live under ``home`` (``FLWR_HOME``)::

    nodes = [{"partition-id": client} for client in range(3)]
    with LocalFederation(home, nodes) as federation:
        run = federation.run(app_dir, {"spec": "/abs/path/spec.toml"})
        print(run.returncode, run.log_path)

Leaving the ``with`` block (or :meth:`LocalFederation.stop`) ends every process the federation
started, the ClientApp and ServerApp processes Flower spawned included.

Flower's programs are found next to this Python (its virtual environment's ``bin``); without the
``flower`` extra, one line naming it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pfl_core.errors import PflError
from pfl_core.spec import dump_toml

CONNECT_TIMEOUT = 120.0  # seconds for the SuperLink to listen and every SuperNode to connect
STOP_GRACE = 10.0  # seconds a process group gets after SIGTERM before SIGKILL
POLL_SECONDS = 0.5
FEDERATION = "local"  # its name in FLWR_HOME/config.toml


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (held together while picked)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class FlowerRun:
    """One ``flwr run``: its exit code, Flower's run id (None if it did not start), its output's file.
    flwr 1.42's ``flwr run --stream`` exits 0 also when the ServerApp failed: check what the run
    wrote (its MLflow run) or its log."""

    returncode: int
    run_id: int | None
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class LocalFederation:
    """One SuperLink and one SuperNode per entry of ``node_configs`` (its ``--node-config``)."""

    def __init__(self, home: str | Path, node_configs: list[dict], bin_dir: str | Path | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT):
        self.home = Path(home).resolve()
        self.node_configs = [dict(config) for config in node_configs]
        self.bin_dir = Path(bin_dir) if bin_dir else Path(sys.executable).parent
        self.connect_timeout = connect_timeout
        self.processes: dict[str, subprocess.Popen] = {}  # name -> process (each its own group)
        self.address = ""  # the SuperLink's host:port once started
        self._runs = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Start the SuperLink, then the SuperNodes; return once every node is connected."""
        for program in ("flower-superlink", "flower-supernode", "flwr"):
            if not (self.bin_dir / program).exists():
                raise PflError(f"{self.bin_dir / program} not found: Flower is not installed in this environment "
                               "(optional extra: pip install -e '.[flower]')")
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        link_port, *node_ports = free_ports(1 + len(self.node_configs))
        self.address = f"127.0.0.1:{link_port}"
        (self.home / "config.toml").write_text(dump_toml(
            {"superlink": {"default": FEDERATION, FEDERATION: {"address": self.address, "insecure": True}}}))
        # the app's dependencies are this environment's: no per-run `uv sync` (needs no network)
        self._spawn("superlink", ["flower-superlink", "--insecure", "--database", ":flwr-in-memory-state:",
                                  "--port", str(link_port), "--disable-runtime-dependency-installation"])
        self._wait(lambda: _listening(link_port), "the SuperLink to listen on " + self.address)
        for index, (config, port) in enumerate(zip(self.node_configs, node_ports)):
            config_path = self.home / f"node{index}.toml"  # a file: any value, no shell quoting
            config_path.write_text(dump_toml(config))
            self._spawn(f"supernode{index}", ["flower-supernode", "--insecure", "--superlink", self.address,
                                              "--port", str(port), "--node-config", str(config_path)])
        self._wait(lambda: self.online_nodes() >= len(self.node_configs),
                   f"{len(self.node_configs)} SuperNode(s) to connect to the SuperLink")

    def stop(self) -> None:
        """End every process started here with its children (SIGTERM, then SIGKILL after a grace)."""
        for process in reversed(list(self.processes.values())):
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(process, signal.SIGKILL)  # the group's spawned children too, whatever the leader did
            process.wait()
        self.processes.clear()

    # -- use ---------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """The environment of every Flower program started here."""
        return {**os.environ, "FLWR_HOME": str(self.home),
                "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",  # nodes start flower-superexec
                "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}

    def online_nodes(self) -> int:
        """How many SuperNodes the SuperLink lists as online (``flwr supernode list``)."""
        listed = subprocess.run([str(self.bin_dir / "flwr"), "supernode", "list", "--format", "json"],
                                check=False, env=self.env(), capture_output=True, text=True, cwd=self.home)
        try:
            nodes = json.loads(listed.stdout).get("nodes", [])
        except json.JSONDecodeError:
            return 0
        return sum(node.get("status") == "online" for node in nodes)

    def run(self, app: str | Path, run_config: dict | None = None, timeout: float | None = None) -> FlowerRun:
        """``flwr run APP --stream`` on this federation, ``run_config`` overriding the app's run
        config; its output goes to a log file under ``home``. ``timeout`` (seconds) ends it."""
        self._runs += 1
        log_path = self.home / "logs" / f"flwr-run-{self._runs}.log"
        command = [str(self.bin_dir / "flwr"), "run", str(Path(app).resolve()), "--stream"]
        if run_config:
            overrides = self.home / f"run-config-{self._runs}.toml"
            overrides.write_text(dump_toml(run_config))
            command += ["--run-config", str(overrides)]
        with log_path.open("w") as log:
            process = subprocess.Popen(command, env=self.env(), cwd=self.home, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
                raise PflError(f"flwr run {app}: still running after {timeout:.0f} s (output: {log_path})") from None
        started = re.search(r"Successfully started run (\d+)", log_path.read_text(errors="replace"))
        return FlowerRun(returncode, int(started.group(1)) if started else None, log_path)

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self, name: str, command: list[str]) -> None:
        log = (self.home / "logs" / f"{name}.log").open("w")
        with log:  # the child holds its own copy of the file
            self.processes[name] = subprocess.Popen(
                [str(self.bin_dir / command[0]), *command[1:]], env=self.env(), cwd=self.home, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)  # its own group: stop() ends its children too

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.connect_timeout
        while not ready():
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise PflError(f"{name} exited with code {process.returncode} while waiting for {what}: "
                                   f"{_last_line(self.home / 'logs' / f'{name}.log')}")
            if time.monotonic() > deadline:
                raise PflError(f"local Flower federation: no {what} within {self.connect_timeout:.0f} s "
                               f"(logs: {self.home / 'logs'})")
            time.sleep(POLL_SECONDS)


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"
