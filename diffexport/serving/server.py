"""A Triton Inference Server for a model repository, started here for local use: the `tritonserver`
on PATH (NVIDIA's container), else the one the nvidia-pytriton wheel bundles. The wheel's server
runs the Python backend through a stub built per Python version; a backend folder of links
(beside the server's log) gives it this interpreter's stub, and this interpreter's libpython.
Ports are bound on 127.0.0.1 only; a copied repository served in a container is the way to serve
others (docs/DEPLOYMENT.md).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from diffexport.core.errors import DiffExportError
from diffexport.core.stoppable import die_with_parent

# Seconds between SIGTERM and SIGKILL when the server is stopped (Triton's own exit timeout is one
# less): diffexport itself ends within stoppable.GRACE_SECONDS of a signal, and its server with it.
STOP_SECONDS = 4.0
INSTALL_HINT = ('no Triton server: `pip install -e ".[serve]"` (nvidia-pytriton\'s bundled tritonserver), or run in '
                "NVIDIA's tritonserver container")


def check_bundled_numpy() -> None:
    """nvidia-pytriton 0.7's Python-backend stubs read and write string tensors (text_input,
    text_output) through a pybind11 that numpy 2 breaks (each string arrives as its first byte
    repeated; seen here with numpy 2.4 on 2026-11-26): the wheel pins numpy < 2 for that reason."""
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise DiffExportError(f"nvidia-pytriton's bundled server needs numpy < 2 (its own pin; numpy "
                              f"{numpy.__version__} is installed): pip install \"numpy<2\", or serve the repository "
                              "with NVIDIA's tritonserver container")


@dataclass
class ServerBinary:
    path: Path
    bundled_root: Path | None = None  # the nvidia-pytriton wheel's tritonserver/ folder, else None


def find_tritonserver() -> ServerBinary:
    """The server: `tritonserver` on PATH first (a container's own), else nvidia-pytriton's."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerBinary(Path(on_path))
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
        if (root / "bin" / "tritonserver").is_file():
            return ServerBinary(root / "bin" / "tritonserver", root)
    raise DiffExportError(INSTALL_HINT)


def python_backend_dir(root: Path, into: Path) -> Path:
    """A backend folder for the bundled server: links to its Python backend and to the stub built
    for this interpreter's Python version (links: the stub finds its libraries next to itself)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise DiffExportError(f"the bundled Triton server has no Python backend stub for Python {version}")
    backend = into / "python"
    backend.mkdir(parents=True)
    for source in (root / "backends" / "python" / "libtriton_python.so",
                   root / "backends" / "python" / "triton_python_backend_utils.py", stub):
        (backend / source.name).symlink_to(source)
    return into


@dataclass
class TritonServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log: Path
    scratch: Path | None = None
    stopped: bool = field(default=False)
    metrics_port: int | None = None  # Triton's Prometheus endpoint, when asked for

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        return None if self.metrics_port is None else f"http://127.0.0.1:{self.metrics_port}/metrics"

    def ended_on_its_own(self) -> str | None:
        """Why the server ended without being stopped here (a crash, a failed bind), in one line with
        its log's path; None while it runs or after stop()."""
        status = self.process.poll()
        if status is None or self.stopped:
            return None
        how = f"killed by signal {-status}" if status < 0 else f"exit {status}"
        return f"tritonserver ended on its own ({how}): {_log_tail(self.log)} (log: {self.log})"

    def stop(self, timeout: float = STOP_SECONDS) -> int:
        """SIGTERM (Triton unloads its models and ends), SIGKILL after timeout; -> its exit status."""
        if not self.stopped:
            self.stopped = True
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            if self.scratch is not None:  # the links; the log stays for the user to read
                shutil.rmtree(self.scratch / "backends", ignore_errors=True)
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _log_tail(log: Path, lines: int = 3) -> str:
    try:
        text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [line for line in text if line.startswith("E") or "error" in line.lower()]
    return " | ".join((errors or text)[-lines:])[:400]


def _flags(http_port: int, grpc_port: int, metrics_port: int | None) -> list[tuple[str, int]]:
    flags = [("--http-port", http_port), ("--grpc-port", grpc_port)]
    return flags + ([("--metrics-port", metrics_port)] if metrics_port is not None else [])


def check_ports(http_port: int, grpc_port: int, metrics_port: int | None = None) -> None:
    flags = _flags(http_port, grpc_port, metrics_port)
    for flag, port in flags:
        if not 1 <= port <= 65535:
            raise DiffExportError(f"{flag} {port} is not in 1..65535")
    for index, (flag, port) in enumerate(flags):
        for other, same in flags[index + 1:]:
            if port == same:
                raise DiffExportError(f"{flag} and {other} must differ, both are {port}")


def check_ports_free(http_port: int, grpc_port: int, metrics_port: int | None = None) -> None:
    """Every port can be bound on 127.0.0.1 now: another server there would answer in our place."""
    for flag, port in _flags(http_port, grpc_port, metrics_port):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # as servers bind: a closed connection's TIME_WAIT does not hold the port, a listener does
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError as exc:
                raise DiffExportError(f"port {port} on 127.0.0.1 is taken ({exc.strerror or exc}): another server "
                                      f"runs there; stop it or give {flag}") from None


def repository_models(repository: Path) -> list[str]:
    """The models of a repository: its folders holding a config.pbtxt."""
    return sorted(p.name for p in repository.iterdir() if (p / "config.pbtxt").is_file() and not p.is_symlink())


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def start_server(repository: str | os.PathLike, http_port: int = 8000, grpc_port: int = 8001,
                 log: str | os.PathLike | None = None, ready_timeout: float = 120.0,
                 metrics_port: int | None = None) -> TritonServer:
    """tritonserver over `repository`, listening on 127.0.0.1, its log in `log` (default: a file
    in a fresh temporary folder); returns once it answers that every model of the repository is
    ready while it runs, or raises with the log's last error line (the process stopped). The server
    ends with this process (it gets SIGTERM when its parent dies, however that happens), and is
    stopped when anything, Ctrl-C included, interrupts the wait. metrics_port: Triton's Prometheus
    endpoint (its nv_* metrics and the model's own: serving/metrics.py) on 127.0.0.1; None: none."""
    repository = Path(repository)
    if not repository.is_dir():
        raise DiffExportError(f"{repository} is not a folder: give the repository `diffexport triton` wrote")
    check_ports(http_port, grpc_port, metrics_port)
    check_ports_free(http_port, grpc_port, metrics_port)
    models = repository_models(repository)
    binary = find_tritonserver()
    if binary.bundled_root is not None:
        check_bundled_numpy()
    scratch = Path(tempfile.mkdtemp(prefix="diffexport-triton."))
    log = Path(log) if log is not None else scratch / "tritonserver.log"
    args = [str(binary.path), "--model-repository", str(repository.resolve()), "--http-address", "127.0.0.1",
            "--grpc-address", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
            "--exit-timeout-secs", str(int(STOP_SECONDS) - 1), "--strict-readiness", "true"]
    if metrics_port is None:
        args += ["--allow-metrics", "false"]
    else:  # the model's metrics need no GPU: Triton's GPU metrics stay off
        args += ["--allow-metrics", "true", "--allow-gpu-metrics", "false", "--metrics-address", "127.0.0.1",
                 "--metrics-port", str(metrics_port)]
    env = dict(os.environ)
    if binary.bundled_root is not None:
        args += ["--backend-directory", str(python_backend_dir(binary.bundled_root, scratch / "backends"))]
        libdir = sysconfig.get_config_var("LIBDIR") or ""
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    with open(log, "wb") as out:
        # Its own session (Ctrl-C in the terminal reaches diffexport, which stops it), and SIGTERM when
        # diffexport ends, even by SIGKILL: the server never outlives its supervisor.
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    server = TritonServer(process, http_port, grpc_port, log, scratch, metrics_port=metrics_port)
    urls = [f"{server.url}/v2/health/ready", *(f"{server.url}/v2/models/{name}/ready" for name in models)]
    deadline = time.monotonic() + ready_timeout
    try:
        while True:
            if process.poll() is not None:
                raise DiffExportError(f"tritonserver stopped (exit {process.returncode}): {_log_tail(log)} "
                                      f"(log: {log})")
            # ready only while our process runs: a server that took the port meanwhile is not ours
            if all(_ready(url) for url in urls) and process.poll() is None:
                return server
            if time.monotonic() > deadline:
                raise DiffExportError(f"tritonserver was not ready within {ready_timeout:.0f} s: {_log_tail(log)} "
                                      f"(log: {log})")
            time.sleep(0.25)
    except BaseException:  # a refusal, Ctrl-C or SIGTERM while the models load: the server goes too
        server.stop()
        raise
