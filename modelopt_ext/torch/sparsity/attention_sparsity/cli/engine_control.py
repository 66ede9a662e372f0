"""Engine control for the calibration command: signals, the engine's shutdown and leftover processes, a private
temporary folder, and stderr held until the arguments are accepted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time

# vLLM names ZMQ sockets <tmp>/<uuid4>; a socket path has at most 107 bytes: <= 57 + "/mxc_xxxxxxxx/" + 36.
MAX_TMPDIR_LEN = 57


class Interrupted(BaseException):
    """SIGINT / SIGTERM arrived: unwind, shut the engine down, write nothing."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_interrupt():
    """SIGTERM and SIGINT raise `Interrupted` in the main thread (Python's default SIGTERM kills the process without
    unwinding, which left vLLM's EngineCore and workers running)."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_ignored():
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def shutdown_engine(llm) -> None:
    """Stop the engine's processes now (EngineCore, workers), not at garbage collection."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def _vllm_kill_process_tree():
    """vLLM's `kill_process_tree` (vllm.utils.system_utils; vllm.utils in older releases)."""
    try:
        from vllm.utils.system_utils import kill_process_tree
    except ImportError:
        from vllm.utils import kill_process_tree
    return kill_process_tree


def end_leftover_processes(grace: float = 10.0) -> list[int]:
    """After the engine's own shutdown: the engine processes of ours still alive after `grace` seconds (EngineCore,
    workers, ...) go with vLLM's `kill_process_tree` (SIGKILL to each one and everything under it). Returns their
    PIDs. multiprocessing's resource tracker is no engine process (it unlinks shared memory after us) and
    `kill_process_tree` would kill it with the rest: it is never a target and is left to exit with us."""
    try:
        import psutil

        kill_process_tree = _vllm_kill_process_tree()
    except ImportError:  # vLLM depends on psutil; without either there is nothing more to do here
        return []
    me = psutil.Process()
    deadline = time.monotonic() + grace
    while True:
        left = [p for p in me.children(recursive=True) if _is_engine_process(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc in left:  # one call per process: a tree already gone with its parent's is skipped
        with contextlib.suppress(psutil.Error, OSError):
            if proc.is_running():
                kill_process_tree(proc.pid)
    psutil.wait_procs(left, timeout=5)  # collect our own children's exit status (no zombies left behind)
    return [p.pid for p in left]


def _is_engine_process(proc) -> bool:
    import psutil

    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return "resource_tracker" not in " ".join(proc.cmdline())
    except psutil.Error:
        return False


@contextlib.contextmanager
def private_tmpdir():
    """The engine's temporary files (ZMQ sockets, torch.distributed's file store, ...) in a folder of our own,
    removed after the engine is down: vLLM leaves some of them behind, all of them when it is interrupted."""
    base = tempfile.gettempdir()
    if len(base) > MAX_TMPDIR_LEN and os.access("/tmp", os.W_OK | os.X_OK):
        base = "/tmp"  # ZMQ's ipc:// socket paths must stay under 108 bytes
    path = tempfile.mkdtemp(prefix="mxc_", dir=base)
    saved_env, saved_cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = path, path
    try:
        yield path
    finally:
        tempfile.tempdir = saved_cached
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ fit and write


@contextlib.contextmanager
def held_stderr():
    """Hold what is written to stderr (file descriptor 2) until the arguments are accepted: importing vLLM (for its
    parser) prints warnings there, and a mistake must still be the one line on stderr. Replayed unless the block
    ends with SystemExit (an argument error, --help): a good run, or a crash, shows all of it."""
    with contextlib.suppress(ValueError, OSError):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        replay = True
        try:
            yield
        except SystemExit:
            replay = False
            raise
        finally:
            with contextlib.suppress(ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if replay:
                held.seek(0)
                data = held.read()
                while data:
                    data = data[os.write(2, data):]
