"""The suite's processes, forked from a preloaded server instead of started anew.

A fresh ``python`` that imports torch, exactstep and their dependencies spends about
2.3 s before its first line of work, and the suite starts hundreds. ``Popen`` has the
part of ``subprocess.Popen``'s interface the tests use and starts a command as a fork
of a server that imported all of that once (one server per test process, started in
the background at the first use). The child is made what a fresh process would be:
its own argv, working directory, environment, standard streams, session, signal
dispositions, fresh RNG seeds (Python, NumPy, torch) and intra-op thread count from
``OMP_NUM_THREADS``; it exits as the interpreter does (non-daemon threads joined,
``atexit`` run, streams flushed; an uncaught ``KeyboardInterrupt`` ends it by SIGINT).
The workers a ``torchrun`` agent in such a child starts are forks of the same server.

What a fork cannot be, a real process is (``plain_reason`` says why): another
interpreter or interpreter flags, options the server does not carry (``preexec_fn``,
``pass_fds``, a shell), or an environment that differs from the server's in a
variable read when a process starts (the C library's allocator, PyTorch's OpenMP and
MKL settings other than ``OMP_NUM_THREADS``, Python's own but for directories put
before ``PYTHONPATH``, whose ``sitecustomize`` the child imports). Where the server cannot
start, every command runs as a real process. ``EXACTSTEP_TEST_PLAIN_PROCESSES=1``
turns the server off for a run of the suite.
"""

from __future__ import annotations

import array
import atexit
import io
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PIPE, DEVNULL, STDOUT = subprocess.PIPE, subprocess.DEVNULL, subprocess.STDOUT
REAL_POPEN = subprocess.Popen
SERVER = Path(__file__).resolve()
PLAIN_SWITCH = "EXACTSTEP_TEST_PLAIN_PROCESSES"

#: Imported once by the server: what the suite's processes import (the command line's
#: bodies, the optimizer's dynamo import, matplotlib for plots, the HF stack).
PRELOAD = ("numpy", "torch", "torch._dynamo", "torch.distributed",
           "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
           "torch.distributed.launcher.api", "safetensors.torch",
           "tqdm", "matplotlib", "matplotlib.pyplot", "exactstep", "exactstep.cli",
           "exactstep.run.runner", "exactstep.run.continuation", "exactstep.run.finished_run",
           "exactstep.artifacts.export", "exactstep.artifacts.prepare", "exactstep.families.registry",
           "transformers", "peft")
#: Variables read when a process starts (by the C library, OpenMP, MKL, PyTorch's
#: import or Python): a command whose value differs from the server's runs as a real
#: process. ``OMP_NUM_THREADS`` is the exception: the child sets its thread count from
#: it. Those torch reads at run time (``TORCHELASTIC_*``, ``TORCH_NCCL_*``, the
#: launcher's ``RANK`` and the like) may differ.
STARTUP_PREFIXES = ("MALLOC_", "GLIBC_", "LD_", "PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_",
                    "OPENBLAS_", "PYTORCH", "TORCH_LOGS", "TORCHDYNAMO", "TORCHINDUCTOR",
                    "TORCH_COMPILE", "TORCH_SHOW_CPP", "TORCH_CPP", "TORCH_USE",
                    "TORCH_CUDA", "TORCH_DEVICE", "TORCH_FORCE", "CUDA", "NVIDIA", "MPL",
                    "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TMPDIR", "HOME", "LANG", "LC_",
                    PLAIN_SWITCH)
EMULATED = ("OMP_NUM_THREADS",)


def prepended_paths(child: str, server: str) -> list[str] | None:
    """The directories ``child``'s ``PYTHONPATH`` puts before ``server``'s, or None
    when it is not the server's with directories put before it."""
    ours = [p for p in server.split(os.pathsep) if p]
    theirs = [p for p in child.split(os.pathsep) if p]
    if ours and theirs[len(theirs) - len(ours):] != ours:
        return None
    return theirs[: len(theirs) - len(ours)]
KNOWN_OPTIONS = {"stdin", "stdout", "stderr", "cwd", "env", "text", "universal_newlines",
                 "encoding", "errors", "start_new_session", "bufsize", "close_fds"}


# --------------------------------------------------------------------------- the client


class _Server:
    """This process's server: started on first use, stopped when this process exits."""

    lock = threading.Lock()
    process: Any = None
    path: str | None = None
    env: dict[str, str] = {}
    failed: str | None = None

    @classmethod
    def address(cls) -> str | None:
        with cls.lock:
            if cls.failed is None and cls.process is None:
                cls.start()
            if cls.failed is not None:
                return None
            if cls.path is not None and not os.path.exists(cls.path + ".ready"):
                cls.wait_ready()
            return None if cls.failed else cls.path

    @classmethod
    def start(cls) -> None:
        if os.environ.get(PLAIN_SWITCH) == "1":
            cls.failed = f"{PLAIN_SWITCH}=1"
            return
        folder = tempfile.mkdtemp(prefix="exactstep-forks-")
        cls.path = os.path.join(folder, "server")
        cls.env = {k: v for k, v in os.environ.items() if k not in EMULATED}
        cls.process = REAL_POPEN([sys.executable, str(SERVER), cls.path, str(os.getpid())],
                                 env=cls.env, stdin=DEVNULL, stdout=DEVNULL,
                                 stderr=open(cls.path + ".log", "wb"))
        atexit.register(cls.stop)

    @classmethod
    def wait_ready(cls, limit_s: float = 120.0) -> None:
        deadline = time.monotonic() + limit_s
        while not os.path.exists(cls.path + ".ready"):
            if cls.process.poll() is not None or time.monotonic() > deadline:
                cls.failed = "the server did not start: " + Path(cls.path + ".log").read_text(
                    errors="replace")[-2000:]
                return
            time.sleep(0.02)
        said = Path(cls.path + ".ready").read_text()
        if said != "ok":
            cls.failed = said

    @classmethod
    def stop(cls) -> None:
        if cls.process is not None and cls.process.poll() is None:
            cls.process.terminate()
            try:
                cls.process.wait(10)
            except subprocess.TimeoutExpired:
                cls.process.kill()


def start_server() -> None:
    """Start this process's server now, in the background (the suite calls it at
    start-up, so that it has imported everything by the first command)."""
    with _Server.lock:
        if _Server.failed is None and _Server.process is None:
            _Server.start()


def plain_reason(args: Any, options: dict[str, Any]) -> str | None:
    """Why ``args`` with ``options`` must run as a real process, or None."""
    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        return f"options {sorted(unknown)}"
    if options.get("close_fds") is False or options.get("bufsize", -1) not in (-1, 0, 1):
        return "close_fds or bufsize"
    if isinstance(args, (str, bytes)) or not args:
        return "not an argument list"
    if target_of([str(a) for a in args]) is None:
        return "not this interpreter, or interpreter flags"
    env = options.get("env")
    if env is not None:
        server = _Server.env or {k: v for k, v in os.environ.items() if k not in EMULATED}
        for key in set(env) ^ set(server) | {k for k in env if k in server and env[k] != server[k]}:
            if key in EMULATED:
                if key in env and not env[key].isdigit():
                    return f"{key}={env[key]!r}"
            elif key == "PYTHONPATH":
                if prepended_paths(env.get(key, ""), server.get(key, "")) is None:
                    return "PYTHONPATH other than the server's with directories before it"
            elif key.startswith(STARTUP_PREFIXES):
                return f"{key} differs from the server's"
    elif os.environ.get(PLAIN_SWITCH) == "1":
        return PLAIN_SWITCH
    return None


def target_of(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """``(kind, what, argv)`` of a command the server runs: ``("module", name, argv)``
    for ``python -m name``, ``("code", source, argv)`` for ``python -c``, ``("script",
    path, argv)``, or the ``exactstep`` console script of this interpreter."""
    exe, rest = argv[0], argv[1:]
    console = Path(sys.executable).with_name("exactstep")
    if os.path.abspath(exe) in (os.path.abspath(str(console)),):
        return ("module", "exactstep", [str(console), *rest])
    if os.path.abspath(exe) != os.path.abspath(sys.executable) or not rest:
        return None
    if rest[0] == "-m" and len(rest) > 1:
        return ("module", rest[1], [rest[1], *rest[2:]])
    if rest[0] == "-c" and len(rest) > 1:
        return ("code", rest[1], ["-c", *rest[2:]])
    if rest[0].startswith("-"):
        return None
    return ("script", rest[0], rest)


class Popen:
    """``subprocess.Popen`` for the suite: a fork of the server where ``plain_reason``
    finds nothing against it, else a real process (``self.real``)."""

    def __init__(self, args: Any, **options: Any) -> None:
        self.args = args
        self.returncode: int | None = None
        self.real: Any = None
        self.stdin = self.stdout = self.stderr = None
        reason = plain_reason(args, options)
        address = None if reason else _Server.address()
        if address is None:
            self.real = REAL_POPEN(args, **options)
            self.pid = self.real.pid
            self.stdin, self.stdout, self.stderr = (self.real.stdin, self.real.stdout,
                                                    self.real.stderr)
            return
        self._fork(address, [str(a) for a in args], options)

    # -- starting
    def _fork(self, address: str, argv: list[str], options: dict[str, Any]) -> None:
        text = bool(options.get("text") or options.get("universal_newlines")
                    or options.get("encoding") or options.get("errors"))
        ours: list[int] = []  # this side's ends of pipes, closed once sent
        fds = []
        for stream, default in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
            value = options.get(stream)
            if value is None:
                fds.append(default)
            elif value == PIPE:
                r, w = os.pipe()
                if stream == "stdin":
                    fds.append(r)
                    ours.append(r)
                    self.stdin = self._wrap(os.fdopen(w, "wb"), text, options, write=True)
                else:
                    fds.append(w)
                    ours.append(w)
                    setattr(self, stream, self._wrap(os.fdopen(r, "rb"), text, options))
            elif value == DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                fds.append(fd)
                ours.append(fd)
            elif value == STDOUT and stream == "stderr":
                fds.append(fds[1])
            elif isinstance(value, int):
                fds.append(value)
            else:
                fds.append(value.fileno())
        env = options.get("env")
        request = {"target": target_of(argv), "cwd": str(options.get("cwd") or os.getcwd()),
                   "env": dict(os.environ if env is None else env),
                   "session": bool(options.get("start_new_session")),
                   "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(address)
        payload = pickle.dumps(request)
        self._conn.sendmsg([len(payload).to_bytes(8, "little") + payload],
                           [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        for fd in ours:
            os.close(fd)
        self.pid = int.from_bytes(_recv_exact(self._conn, 8), "little", signed=True)
        if self.pid < 0:
            raise OSError("the process server could not fork")

    @staticmethod
    def _wrap(raw: Any, text: bool, options: dict[str, Any], write: bool = False) -> Any:
        if not text:
            return raw
        return io.TextIOWrapper(raw, encoding=options.get("encoding") or "utf-8",
                                errors=options.get("errors") or "strict",
                                line_buffering=write)

    # -- the subprocess.Popen interface
    def poll(self) -> int | None:
        if self.real is not None:
            self.returncode = self.real.poll()
            return self.returncode
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.real is not None:
            self.returncode = self.real.wait(timeout)
            return self.returncode
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        status = int.from_bytes(_recv_exact(self._conn, 8), "little", signed=True)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._conn.close()

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple:
        if self.real is not None:
            out = self.real.communicate(input, timeout)
            self.returncode = self.real.returncode
            return out
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[str, Any] = {}

        def drain(name: str) -> None:
            stream = getattr(self, name)
            results[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=drain, args=(n,), daemon=True)
                   for n in ("stdout", "stderr") if getattr(self, n) is not None]
        for t in readers:
            t.start()
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.real is not None:
            self.real.send_signal(sig)
        elif self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: Any) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def run(args: Any, *, input: Any = None, capture_output: bool = False,
        timeout: float | None = None, check: bool = False, **options: Any
        ) -> subprocess.CompletedProcess:
    """``subprocess.run`` over ``Popen``."""
    if capture_output:
        options["stdout"] = options["stderr"] = PIPE
    if input is not None:
        options["stdin"] = PIPE
    with Popen(args, **options) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    result = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        result.check_returncode()
    return result


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise OSError("the process server closed the connection")
        data += chunk
    return data


# --------------------------------------------------------------------------- the server


def serve(path: str, client_pid: int) -> None:
    """Preload, then fork one child per request until the client process is gone."""
    import importlib

    _Server.path, _Server.env, _Server.process = path, dict(os.environ), "the parent"

    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an extra not installed: its commands import it
            failed.append(f"{name}: {exc}")
    probe = os.fork()  # NumPy's OpenBLAS stops its thread pool before a fork (atfork)
    if probe == 0:
        os._exit(0)
    os.waitpid(probe, 0)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    ready = "ok" if threads == 1 else f"the server runs {threads} threads after its imports"
    Path(path + ".tmp").write_text(ready)
    os.replace(path + ".tmp", path + ".ready")
    if ready != "ok":
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    waiting: dict[int, socket.socket] = {}  # child -> its client's connection
    ended: dict[int, int] = {}  # child -> wait status, until its connection is known

    def report() -> None:
        for pid in [p for p in ended if p in waiting]:
            conn = waiting.pop(pid)
            try:
                conn.sendall(ended.pop(pid).to_bytes(8, "little", signed=True))
            except OSError:
                pass
            conn.close()

    while True:
        try:
            os.kill(client_pid, 0)
        except ProcessLookupError:
            return
        readable = select.select([listener, wake_r], [], [], 1.0)[0]
        if wake_r in readable:
            os.read(wake_r, 4096)
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            ended[pid] = status
        report()
        if listener in readable:
            conn, _ = listener.accept()
            request, fds = receive_request(conn)
            pid = os.fork()
            if pid == 0:  # the child never returns
                listener.close()
                os.close(wake_r)
                os.close(wake_w)
                for other in waiting.values():
                    other.close()
                conn.close()
                become(request, fds)
            for fd in set(fds):
                os.close(fd)
            conn.sendall(pid.to_bytes(8, "little", signed=True))
            waiting[pid] = conn
            report()


def receive_request(conn: socket.socket) -> tuple[dict, list[int]]:
    msg, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    size = int.from_bytes(msg[:8], "little")
    payload = msg[8:]
    while len(payload) < size:
        payload += conn.recv(size - len(payload))
    return pickle.loads(payload), list(fds)


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: be the requested process, run it, exit as Python does."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL if number != signal.SIGPIPE
                          else signal.SIG_IGN)  # Python ignores SIGPIPE at start-up
        # a real child inherits an ignored SIGINT, else Python installs its handler
        signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"]
                      else signal.default_int_handler)
        if request["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                      line_buffering=os.isatty(1), write_through=False)
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                      line_buffering=True, errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        fresh_process_state(request["env"])
        fork_torchrun_workers()
        code = run_target(request["target"])
    except BaseException:  # the set-up itself failed: say so as Python would
        import traceback

        traceback.print_exc()
        code = 1
    finish(code)


def fresh_process_state(env: dict[str, str]) -> None:
    """What a new interpreter would have that a fork shares with its server: fresh
    seeds, and the intra-op thread count ``OMP_NUM_THREADS`` gives."""
    import random

    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    torch.seed()
    threads = env.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))


def fork_torchrun_workers() -> None:
    """The workers a ``torchrun`` agent in this child starts (``exactstep train
    --nproc``) are forks of the same server too: the agent's ``Popen`` is this
    module's (the agent polls, signals its session and reads each exit code through
    it; a command the server cannot be is still a real process)."""
    module = sys.modules.get(
        "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler")
    if module is not None:
        module.Popen = Popen


def run_target(target: tuple[str, str, list[str]]) -> int:
    """Run ``python -m``/``-c``/a script as ``__main__``; the exit code Python gives."""
    import runpy

    kind, what, argv = target
    sys.argv = list(argv)
    if kind == "module":
        sys.path[0] = os.getcwd()
    elif kind == "code":
        sys.path[0] = ""
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(what))
    start_up_paths()
    try:
        if kind == "module":
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        elif kind == "code":
            import types

            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(what, "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(what, run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc)
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        finish(None)
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    return 0


def start_up_paths() -> None:
    """What a fresh interpreter does with ``PYTHONPATH`` directories the server did not
    have: put them after the script's directory, and import a ``sitecustomize`` found
    in them (``site`` runs it at start-up, before ``__main__``)."""
    extra = prepended_paths(os.environ.get("PYTHONPATH", ""),
                            _Server.env.get("PYTHONPATH", "")) or []
    sys.path[1:1] = extra
    if any(os.path.isfile(os.path.join(d, "sitecustomize.py")) for d in extra):
        sys.modules.pop("sitecustomize", None)
        import sitecustomize  # noqa: F401  (its effects are the point)


def exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def finish(code: int | None) -> None:
    """Leave as the interpreter does: join non-daemon threads, run ``atexit``, flush;
    ``None``: an uncaught KeyboardInterrupt, which ends the process by SIGINT."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    if code is None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)  # as C's exit(): sys.exit(-1) ends 255


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
