"""Start and stop a real `vllm serve` subprocess for tests and benchmarks."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import socket
import subprocess
import threading
import time

import requests

from plugin_tests.conftest import VLLM


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model: str, args: list[str], log_path: str, env: dict | None = None,
            cwd: str | None = None, memory_flags: bool = True, api_key: str | None = None):
    """``vllm serve MODEL ARGS`` (in ``cwd``) up and ready for the block (``.model``
    set), stopped after it; ``memory_flags`` and ``api_key`` as :class:`ServeProcess`
    takes them."""
    proc = ServeProcess([model, *args], log_path, env=env, cwd=cwd,
                        memory_flags=memory_flags, api_key=api_key)
    try:
        proc.wait_ready()
        proc.model = model
        yield proc
    finally:
        proc.stop()


class ServeProcess:
    """``vllm serve ARGS`` in its own process group, log in ``log_path``.

    ``prefix``: command words before ``vllm`` (e.g. ``ip netns exec NS``).
    ``memory_flags``: on vLLM's CPU build, give every engine a 1 GiB KV cache
    (``VLLM_CPU_KVCACHE_SPACE``, unless set) and ask for a small share of host memory
    (``--gpu-memory-utilization 0.3``, unless given): tests' pipelines that replace a
    stage's ``runtime`` lose its KV cache size. False: the command as given.
    ``api_key``: started with ``--api-key`` (set the attribute instead for a key given
    through ``VLLM_API_KEY``); :attr:`headers` carry it and the helpers send them.
    """

    def __init__(self, args: list[str], log_path: str, env: dict | None = None,
                 prefix: list[str] | None = None, cwd: str | None = None,
                 memory_flags: bool = True, api_key: str | None = None):
        self.port = free_port()
        self.api_key = api_key
        if api_key is not None:
            args = [*args, "--api-key", api_key]
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        env = dict(env or os.environ)
        if memory_flags:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            if not any(a.startswith("--gpu-memory-utilization") for a in args):
                args = [*args, "--gpu-memory-utilization", "0.3"]
        self.proc = subprocess.Popen(
            [*(prefix or []), VLLM, "serve", *args, "--host", "127.0.0.1",
             "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True,
        )

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stage_worker(self, stage: int) -> tuple[str, int]:
        """``(process name, pid)`` of the process that last logged starting stage
        ``stage``'s ``OmniWorker``: vLLM's worker process, or the EngineCore where the
        worker runs inside it. Fails the test when the log has none."""
        found = re.findall(rf"\((\S+) pid=(\d+)\).*stage {stage}: OmniWorker", self.log())
        assert found, f"stage {stage}'s worker pid is not in the log"
        name, pid = found[-1]
        return name, int(pid)

    def engine_pid(self, stage: int) -> int:
        """Stage ``stage``'s EngineCore: the parent of the worker process that logged
        starting the plugin's worker (vLLM's CPU platform runs the worker in a process of
        its own), or that process itself when the worker runs inside the EngineCore."""
        import psutil

        name, pid = self.stage_worker(stage)
        return pid if name.startswith("EngineCore") else psutil.Process(pid).ppid()

    def payload_files(self) -> int:
        """Files in this server's payload store (its run directories under /dev/shm)."""
        return sum(len(files) for run_dir in glob.glob(
            f"/dev/shm/vllm-omni-plugin-{self.proc.pid}-*") for _, _, files in os.walk(run_dir))

    def stall(self, stage: int, send, in_stage=None, timeout: float = 300):
        """Stop stage ``stage``'s EngineCore (SIGSTOP: a hung kernel or a deadlock, as
        the head sees it), send a request that reaches the stage (``send()``, in a
        thread), and wait for its answer; the head has to notice the stall and kill the
        engine meanwhile. ``in_stage()``: the request is at the stage (default: the
        stage's ``vllm_omni:replica_requests_running`` is 1). The stopped EngineCore and
        its worker processes, taken before the stop, are kept in :attr:`stalled` (see
        :meth:`assert_stalled_killed`).

        Returns:
            ``(answer, seconds)``: what ``send`` returned (or the exception it raised),
            and the seconds from when the request was at the stage to the answer.
        """
        import psutil

        pid = self.engine_pid(stage)
        core = psutil.Process(pid)
        #: the stopped EngineCore and its worker processes (``psutil.Process``)
        self.stalled = [core, *core.children(recursive=True)]
        in_stage = in_stage or (lambda: sum(self.replica_metric(
            "vllm_omni:replica_requests_running", stage).values()) >= 1)
        result = {}

        def call():
            try:
                result["answer"] = send()
            except Exception as exc:  # the answer is the exception (a dropped connection)
                result["answer"] = exc

        os.kill(pid, signal.SIGSTOP)
        sender = threading.Thread(target=call)
        sender.start()
        self.wait_until(lambda: in_stage() or not sender.is_alive(), 120, interval=0.05)
        start = time.monotonic()
        sender.join(timeout)
        return result.get("answer"), time.monotonic() - start

    def assert_stalled_killed(self, timeout: float = 30) -> None:
        """The processes :meth:`stall` stopped (the EngineCore and its workers) are gone
        (exited, or a zombie not reaped yet) within ``timeout`` seconds: the head's kill
        reached every one, whatever it restarts. Fails naming those still running."""
        import psutil

        def running() -> list[str]:
            alive = []
            for process in self.stalled:
                try:  # is_running: False also for another process under a reused pid
                    status = process.status() if process.is_running() else None
                except psutil.NoSuchProcess:
                    continue
                if status not in (None, psutil.STATUS_ZOMBIE):
                    alive.append(f"{process.pid} ({status})")
            return alive

        deadline = time.monotonic() + timeout
        while running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(), f"stalled engine processes still running: {running()}"

    def wait_ready(self, timeout_s: float = 420) -> float:
        """Seconds until ``/health`` answers 200. Raises RuntimeError with the log tail."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-6000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not ready after {timeout_s}s:\n{self.log()[-6000:]}")

    def wait_for_log(self, pattern: str, timeout_s: float = 420) -> re.Match:
        """The first match of regex ``pattern`` in the log, waiting up to ``timeout_s``.

        Raises:
            RuntimeError: the process exited or the pattern did not appear (log tail).
        """
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            match = re.search(pattern, self.log())
            if match:
                return match
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-6000:]}")
            time.sleep(0.5)
        raise RuntimeError(f"{pattern!r} not in the log after {timeout_s}s:\n{self.log()[-6000:]}")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (vllm serve and its EngineCores)."""
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped process cannot exit
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()

    def wait_until(self, predicate, timeout: float, interval: float = 0.1) -> None:
        """Poll ``predicate()`` until true; AssertionError with the log tail after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(interval)
        raise AssertionError(f"condition not met in {timeout}s; log:\n{self.log()[-4000:]}")

    def metric(self, name: str, **labels) -> float | None:
        """``/metrics`` sample ``name`` with exactly ``labels`` (values as ``str``), or
        None when there is none."""
        return self.metrics().get((name, frozenset((k, str(v)) for k, v in labels.items())))

    def replica_metric(self, name: str, stage: int, **labels: str) -> dict[int, float]:
        """``/metrics`` sample ``name`` of each replica of ``stage`` with ``labels``."""
        found = {}
        for (metric, lbls), value in self.metrics().items():
            d = dict(lbls)
            if metric == name and d.get("stage") == str(stage) and all(
                    d.get(k) == v for k, v in labels.items()):
                found[int(d["replica"])] = value
        return found

    def replicas_up(self, stage: int) -> set[int]:
        """The replicas of ``stage`` the head lists as up."""
        return {r for r, v in self.replica_metric("vllm_omni:replica_status", stage,
                                                  status="up").items() if v}

    def attach(self, headless: list[ServeProcess], stage: int, timeout: float = 60,
               local: int = 0) -> dict[int, ServeProcess]:
        """Wait until this head is ready and lists its ``local`` replicas of ``stage``
        (ids from 0) and every ``headless`` replica process of it (the next ids) as up;
        returns the headless ones by replica id (each with ``task_address`` set)."""
        self.wait_ready()
        replicas = {}
        for proc in headless:
            match = proc.wait_for_log(rf"stage {stage} replica (\d+) serving on (tcp://\S+)")
            replicas[int(match.group(1))] = proc
            proc.task_address = match.group(2)
        assert sorted(replicas) == list(range(local, local + len(headless))), sorted(replicas)
        self.wait_until(lambda: self.replicas_up(stage) == set(range(local)) | set(replicas),
                        timeout)
        return replicas

    def chat_body(self, **extra) -> dict:
        """A greedy 12-token chat request ("Say hello") for ``self.model``, ``extra`` merged."""
        return {"model": self.model, "messages": [{"role": "user", "content": "Say hello"}],
                "max_tokens": 12, "temperature": 0, **extra}

    def audio_body(self, **extra) -> dict:
        """:meth:`chat_body` asking for text and audio."""
        return self.chat_body(modalities=["text", "audio"], **extra)

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header of :attr:`api_key` (none without a key)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def chat(self, body: dict, timeout: float = 300) -> requests.Response:
        return requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout,
                             headers=self.headers)

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """``/metrics`` samples as ``{(name, frozenset(labels.items())): value}``."""
        samples = {}
        for line in requests.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            match = re.match(r"^([^#\s{]+)(?:\{(.*)\})?\s+(\S+)$", line)
            if match:
                labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
                samples[(match.group(1), labels)] = float(match.group(3))
        return samples


def check_stall_recovery(server: ServeProcess, stage: int, name: str, stall_s: float,
                         send) -> requests.Response:
    """The stalled-stage scenario on ``server`` (replica 0 of ``stage``, named ``name``,
    a local replica with stall timeout ``stall_s``): its EngineCore is stopped while
    ``send()``'s request is at the stage. Checked: the request is answered within the
    stall timeout plus 10 s, 200 (resubmitted) or 503 naming the stage and the stall; the
    stopped EngineCore and its worker processes are gone (killed, whether or not the
    restart succeeds); the stage is restarted, counted once in
    ``vllm_omni:replica_stalls_total``, and answers the next ``send()`` with 200; no
    payload file or admission slot is left. Returns the stalled request's answer."""
    assert server.replica_metric("vllm_omni:replica_stalls_total", stage) == {0: 0.0}
    answer, seconds = server.stall(stage, send)
    server.assert_stalled_killed()
    assert isinstance(answer, requests.Response), answer
    assert seconds <= stall_s + 10, seconds
    assert answer.status_code in (200, 503), answer.text
    if answer.status_code == 503:
        message = answer.json()["error"]["message"]
        assert f"stage {stage} ({name}): " in message, message
        assert "replica 0 was lost: stalled: its EngineCore answered no liveness probe " \
            f"for {stall_s:g} s" in message, message
    replica = rf"stage {stage} replica 0 \(local [^)]*\)"
    server.wait_for_log(rf"{replica}: stalled(?s:.*){replica}: restarted in [0-9.]+ s", 300)
    assert server.replica_metric("vllm_omni:replica_stalls_total", stage) == {0: 1.0}
    server.wait_until(lambda: 0 in server.replicas_up(stage), 60)
    after = send()
    assert after.status_code == 200, after.text
    server.wait_until(lambda: server.payload_files() == 0 and not any(
        v for (metric, _), v in server.metrics().items()
        if metric == "vllm_omni:stage_requests_in_flight"), 30)
    return answer
