"""A SIGKILLed `k2 rl` takes its children with it (the rollout worker, the reward workers,
multiprocessing's resource tracker) and frees the worker's port; the run then resumes on fresh
ports."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from k2_data import lifetime
from k2_model.testing import SMALL_OVERRIDES
from k2_rl.config import RLConfig
from k2_rl.rollout import RolloutWorker, port_in_use
from k2_train.state import latest_state


def _config(tmp_path: Path, **kw) -> Path:
    cfg = RLConfig.flat(
        model_overrides=SMALL_OVERRIDES,
        iterations=50,
        prompts_per_iteration=2,
        samples_per_prompt=2,
        max_response_tokens=4,
        eval_every=0,
        save_every=1,
        updates_per_iteration=1,
        reward_workers=2,
        threads=1,
        rollout_threads=1,
        kl_every=0,
        out=str(tmp_path / "run"),
        **kw,
    )
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return path


class _Output:
    """The child's stdout, read by a thread (so the pipe never fills), searchable while it runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._t = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._t.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.text += line


def _cmdlines(tree: dict[int, int]) -> dict[int, str]:
    out = {}
    for pid in tree:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return out


def _k2(*args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-m", "k2_stack", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


@pytest.mark.slow  # a real `k2 rl` with a rollout worker and two reward workers
def test_sigkill_of_k2_rl_leaves_no_process_and_no_port(tmp_path):
    proc = _k2("rl", "--config", str(_config(tmp_path)))
    out = _Output(proc)
    try:
        deadline = time.monotonic() + 300
        while True:  # until the first iteration is saved (every child is up by then)
            assert proc.poll() is None, out.text[-3000:]
            assert time.monotonic() < deadline, out.text[-3000:]
            if "rl iteration 1/" in out.text and latest_state(tmp_path / "run") is not None:
                break
            time.sleep(0.2)
        tree = lifetime.descendants(proc.pid)
        kinds = list(_cmdlines(tree).values())
        assert sum("k2_rl.rollout" in c for c in kinds) == 1, kinds
        assert sum("spawn_main" in c for c in kinds) == 2, kinds  # the reward workers
        assert sum("resource_tracker" in c for c in kinds) == 1, kinds
        port = int(re.search(r"rollout worker: pid \d+ at http://127\.0\.0\.1:(\d+)", out.text).group(1))
        assert port_in_use(port)

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + lifetime.GRACE_S + 5
        while (
            left := {p: s for p, s in tree.items() if lifetime.alive(p, s)}
        ) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == {}, _cmdlines(left)
        assert not port_in_use(port)

        # the resumed run starts a worker on a fresh port and runs on to a stop point one iteration
        # past what the killed run logged (iterations are fast: it may have done several)
        logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        stop = max(r["iteration"] for r in logged if "reward_mean" in r) + 1
        resumed = _k2("rl", "--resume", str(tmp_path / "run"), "--stop-at", str(stop))
        text = resumed.communicate(timeout=600)[0]
        assert resumed.returncode == 0, text[-3000:]
        ports = re.findall(r"rollout worker: pid \d+ at http://127\.0\.0\.1:(\d+)", text)
        assert len(ports) == 1 and f"rl iteration {stop}/" in text
        assert not port_in_use(int(ports[0]))  # and closes it when it ends
        rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows if "reward_mean" in r] == list(range(1, stop + 1))
        # a stop point the run has passed is refused, not run past
        again = _k2("rl", "--resume", str(tmp_path / "run"), "--stop-at", str(stop))
        text = again.communicate(timeout=600)[0]
        assert again.returncode == 2 and f"--stop-at {stop}: the run in" in text, text[-2000:]
    finally:
        proc.kill()
        proc.wait()


def test_a_given_rollout_port_in_use_is_refused_by_flag(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(ValueError, match=rf"--rollout-port {taken}: the port is in use"):
            RolloutWorker(tmp_path, port=taken).start()
    with pytest.raises(ValueError, match="rollout_port=70000"):
        RLConfig.flat(rollout_port=70000).validate()
