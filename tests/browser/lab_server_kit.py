"""A throw-away JupyterLab server for the browser tests: 127.0.0.1 only, a random token, and its
own settings, runtime, config and data folders under one temporary directory.

``LabServer(root, notebooks).start()`` waits (bounded) until the server answers; ``stop()`` asks it
to shut down (which stops its kernels), then terminates and finally kills whatever of the server
and its child processes is still alive, so no process outlives the test.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 20

# JupyterLab settings written before the server starts: no news or update checks (no network),
# start the notebook's own kernel without asking, the light theme to begin with (the test
# switches themes through the page).
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"autoStartDefaultKernel": True},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/apputils-extension/themes.jupyterlab-settings": {"theme": "JupyterLab Light"},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    def __init__(self, root: Path, notebooks: Path):
        self.root = Path(root)
        self.notebooks = Path(notebooks)
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None

    # ---- environment -------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "IPYTHON"))}
        dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
                "JUPYTERLAB_SETTINGS_DIR": "settings", "JUPYTERLAB_WORKSPACES_DIR": "workspaces",
                "IPYTHONDIR": "ipython", "MPLCONFIGDIR": "matplotlib"}
        for var, sub in dirs.items():
            (self.root / sub).mkdir(parents=True, exist_ok=True)
            env[var] = str(self.root / sub)
        env["JUPYTER_PLATFORM_DIRS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _write_settings(self) -> None:
        for rel, value in SETTINGS.items():
            f = self.root / "settings" / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(value))

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> LabServer:
        env = self._env()
        self._write_settings()
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.notebooks}",
               "--ServerApp.allow_remote_access=False",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.news_url=None", "--LabApp.extension_manager=readonly",
               "--ServerApp.terminals_enabled=False"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")                  # containers and CI machines often run as root
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the server runs; closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=self.notebooks, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"JupyterLab did not answer on {self.url} within {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def api(self, method: str, path: str, timeout: float = 10):
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"},
                                     data=b"" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def kernel_connected(self, notebook: str) -> bool:
        """Whether ``notebook`` has a kernel that is idle and has a page connected to it."""
        for sess in self.api("GET", "/api/sessions"):
            k = sess.get("kernel") or {}
            if sess.get("path") == notebook and k.get("execution_state") == "idle" and k.get("connections", 0) > 0:
                return True
        return False

    def lab_url(self, notebook: str) -> str:
        return f"{self.url}/lab/tree/{notebook}?token={self.token}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self) -> list[int]:
        """Shut down the server and every process it started; bounded, never raises. Returns the
        ids of the processes still alive afterwards (none, unless even SIGKILL failed)."""
        if self.proc is None:
            return []
        import psutil
        try:
            family = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            family = []
        if self.proc.poll() is None:
            try:
                self.api("POST", "/api/shutdown", timeout=5)
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
        _, alive = psutil.wait_procs(family, timeout=STOP_TIMEOUT_S)
        for signal_them in (psutil.Process.terminate, psutil.Process.kill):   # asked, then forced
            for p in alive:
                try:
                    signal_them(p)
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(alive, timeout=5)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
        self.proc = None
        return [p.pid for p in alive]
