"""A module started from the preloaded server (``ddpkit.runtime.preloaded``) runs as ``python -u -m`` would run it:
its arguments, its environment, the descriptors it inherits, its exit code and output, its exit handlers, a process
group of its own; and the launcher preloads only what it is told to, never a user's program."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ddpkit.runtime.preloaded import start_module
from ddpkit.runtime.process import terminate

CHILD = textwrap.dedent("""
    import atexit, json, os, sys, threading, time

    def report():
        fd = int(os.environ["PROBE_FD"])
        print(json.dumps({"argv": sys.argv[1:], "probe": os.environ.get("PROBE"), "leads": os.getpgid(0) == os.getpid(),
                          "read": os.read(fd, 5).decode(), "name": __name__,
                          "comm": open("/proc/self/comm").read().strip()}))

    def main():
        atexit.register(lambda: print("atexit ran", flush=True))
        what = os.environ.get("PROBE_DO", "")
        if what == "report":
            report()
        elif what == "raise":
            raise ValueError("raised in the child")
        elif what == "message":
            sys.exit("a message instead of a code")
        elif what == "thread":
            def late():
                time.sleep(0.2)
                print("thread done in", sys.modules["__main__"].__spec__.name, flush=True)
            threading.Thread(target=late).start()
        elif what == "interrupt":
            raise KeyboardInterrupt
        elif what == "sleep":
            print("sleeping", flush=True)
            time.sleep(60)
        sys.exit(int(os.environ.get("PROBE_CODE", "0")))

    if __name__ == "__main__":
        main()
""")


@pytest.fixture()
def child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "probes").mkdir()  # a package's module, as ddpkit's are (runpy treats those apart)
    (tmp_path / "probes" / "__init__.py").write_text("")
    (tmp_path / "probes" / "preloaded.py").write_text(CHILD)
    monkeypatch.syspath_prepend(str(tmp_path))  # the server's children take this process's sys.path
    return "probes.preloaded"


def _start(module: str, args: list[str] | None = None, fds: dict[str, int] | None = None, **env: str):
    return start_module(module, args or [], {**os.environ, **env}, preload=("torch",), fds=fds, name="probe-child")


def test_a_module_gets_its_arguments_environment_and_descriptors_and_leads_its_group(child: str) -> None:
    read, write = os.pipe()
    os.write(write, b"hello")
    proc = _start(child, ["--flag", "x y"], fds={"PROBE_FD": read}, PROBE="set", PROBE_DO="report")
    os.close(read)
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    assert proc.wait() == 0, err
    report = json.loads(out.splitlines()[0])
    assert report == {"argv": ["--flag", "x y"], "probe": "set", "leads": True, "read": "hello", "name": "__main__",
                      "comm": "probe-child"}  # run as the main module
    assert out.splitlines()[1:] == ["atexit ran"]
    os.close(write)


def test_a_preloaded_module_runs_again_as_main_without_a_word(child: str, tmp_path: Path) -> None:
    # The server imported the module itself (as ddpkit train's launcher has it import its workers' module): runpy
    # would warn that the module was imported before it ran it as __main__. A process of its own, whose server
    # starts with that preload (this one's may run already, with another), and finds the module on PYTHONPATH.
    driver = textwrap.dedent(f"""
        import os, sys
        from ddpkit.runtime.preloaded import start_module
        read, write = os.pipe()
        os.write(write, b"again")
        proc = start_module({child!r}, [], {{**os.environ, "PROBE_DO": "report"}}, preload=("torch", {child!r}),
                            fds={{"PROBE_FD": read}})
        sys.stdout.write(proc.stdout.read().decode())
        sys.stderr.write(proc.stderr.read().decode())
        sys.exit(proc.wait())
    """)
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(done.stdout.splitlines()[0])["read"] == "again"


@pytest.mark.parametrize(("env", "code", "said"), [
    ({"PROBE_CODE": "3"}, 3, ""),
    ({"PROBE_CODE": "-2"}, 254, ""),  # an exit code, not a signal
    ({"PROBE_DO": "raise"}, 1, "Traceback"),
    ({"PROBE_DO": "message"}, 1, "a message instead of a code"),
    ({"PROBE_DO": "interrupt"}, -signal.SIGINT, "Traceback"),
], ids=["exit 3", "exit -2", "an exception", "exit with a message", "an escaped KeyboardInterrupt"])
def test_it_exits_as_the_interpreter_would(child: str, env: dict, code: int, said: str) -> None:
    # What python -u -m gives each: the code, the message or the traceback, the exit handlers run.
    fresh = subprocess.run([sys.executable, "-u", "-m", child], env={**os.environ, **env}, capture_output=True,
                           text=True, timeout=60, cwd=sys.path[0])
    proc = _start(child, **env)
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    assert proc.wait() == fresh.returncode == code
    assert said in err and said in fresh.stderr and ("Traceback" in err) == ("Traceback" in fresh.stderr)
    assert out.splitlines() == fresh.stdout.splitlines() == ["atexit ran"]


def test_non_daemon_threads_finish_before_the_exit(child: str) -> None:
    proc = _start(child, PROBE_DO="thread")
    # __main__ is still the module's after it returned, as under python -m
    assert proc.stdout.read().decode().splitlines() == [f"thread done in {child}", "atexit ran"]
    assert proc.wait() == 0


def test_a_signal_to_its_group_stops_it_and_reads_as_the_signal(child: str) -> None:
    proc = _start(child, PROBE_DO="sleep")
    assert proc.stdout.readline() == b"sleeping\n"
    assert proc.poll() is None
    terminate([proc], grace_s=5.0)
    assert proc.wait() == -signal.SIGTERM and proc.returncode == -signal.SIGTERM


def _driver(child: str, tmp_path: Path, catch_term: bool = False) -> subprocess.Popen:
    """A launcher of one preloaded child (``PROBE_DO=sleep``), in a session of its own; it prints the child's pid."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        from ddpkit.runtime.preloaded import start_module
        if __name__ == "__main__":
            if {catch_term!r}:
                signal.signal(signal.SIGTERM, lambda *_: None)  # a launcher stopping its workers gracefully
            proc = start_module({child!r}, [], {{**os.environ, "PROBE_DO": "sleep"}}, preload=("torch",))
            assert proc.stdout.readline() == b"sleeping\\n"
            print(proc.pid, flush=True)
            time.sleep(120)
    """)
    (tmp_path / "driver.py").write_text(code)
    return subprocess.Popen([sys.executable, str(tmp_path / "driver.py")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, start_new_session=True)


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_dies_with_a_launcher_killed_outright(child: str, tmp_path: Path) -> None:
    # SIGKILL: the launcher cannot stop its workers; the server must see it gone, exit, and take its children.
    driver = _driver(child, tmp_path)
    try:
        pid = int(driver.stdout.readline())
        driver.kill()
        driver.wait()
        assert _gone(pid, 10.0), "a preloaded child outlived its launcher"
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stdout.close()


def test_a_signal_to_the_launchers_group_is_the_launchers_to_handle(child: str, tmp_path: Path) -> None:
    # `timeout` or a job control signals the launcher's whole group: the server is not in it (nor the children),
    # so the launcher decides how its workers stop; the server's death would have ended them at once.
    driver = _driver(child, tmp_path, catch_term=True)
    try:
        pid = int(driver.stdout.readline())
        os.killpg(driver.pid, signal.SIGTERM)
        assert not _gone(pid, 1.0)
        driver.kill()
        driver.wait()
        assert _gone(pid, 10.0)
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.stdout.close()


def test_the_launcher_preloads_only_what_it_is_told_to() -> None:
    from ddpkit.launcher import LaunchConfig
    from ddpkit.launcher.supervise import preloaded_module

    def preloaded(argv: list[str], **cfg) -> object:
        return preloaded_module(argv, LaunchConfig(program="ddpkit.train.fault_tolerant_loop", module=True, **cfg))

    argv = [sys.executable, "-u", "-m", "ddpkit.train.fault_tolerant_loop", "--x"]
    assert preloaded(argv, preload=("torch",)) == ("ddpkit.train.fault_tolerant_loop", ["--x"])
    assert preloaded(argv) is None  # ddpkit launch: a user's program gets a fresh interpreter, as under torchrun
    assert preloaded(["/other/python", *argv[1:]], preload=("torch",)) is None  # PYTHON_EXEC
    assert preloaded([sys.executable, "-u", "script.py"], preload=("torch",)) is None
