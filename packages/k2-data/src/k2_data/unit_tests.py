"""Unit tests of a program, run in the sandbox: passed only when the tests run to their end.

    res = run_unit_tests("def sq(x):\n    return x * x", "assert sq(3) == 9", timeout_s=10)
    res.passed                           # True; res.result is the SandboxResult

Used by k2-rl's code reward (`k2_rl.rewards.code`) and by the agentic judge's unit-test check
(`k2_data.agentic.judge`) for code tasks whose rubric carries `tests`.

Design (why a nonce, and why it lives in a separate process):

A program that exits early with status 0 (`sys.exit(0)`, `os._exit(0)`), or prints whatever a
success marker looks like, must not score. So success is an unpredictable per-run nonce
(128 random bits from `secrets`) appearing as the last line of stdout, and it must be impossible
for the program to learn it before the tests have passed:

* The grader never puts the program, the tests or the nonce in a file the sandbox can name: they
  travel on two unlinked temporary files passed as inherited fds (`run_python(inputs=...)`), so
  nothing is in the script source (`__file__`, `inspect`), in argv (`/proc/*/cmdline`), or in the
  work dir. The only file in the work dir is the (public) driver below.
* The driver, before any untrusted code runs, forks a *notary*. The notary makes itself
  non-dumpable (`PR_SET_DUMPABLE=0`: a same-uid process can neither ptrace it nor read its
  `/proc/<pid>/mem` or fds), only then reads the nonce from its fd and closes it, and waits on a
  pipe. The driver closes its own copy of the nonce fd without reading it, reads program and
  tests from the other fd and closes that: when untrusted code starts, the nonce is in no memory
  and no fd the program can reach.
* The driver `exec`s the program, then the tests, in one `__main__` namespace. Any exception,
  including `SystemExit` (so `sys.exit(0)` mid-program is a failure) and `KeyboardInterrupt`,
  prints the traceback and ends the process with status 1. Only when the tests' code returns
  normally does the driver flush stdout, tell the notary "pass" and wait for it; the notary then
  writes the nonce on its own stdout fd. If the process ends any other way (`os._exit`, a
  signal, a limit) the notary sees EOF and prints nothing.
* The grader scores 1.0 iff the run exited 0 within all limits and the last stdout line equals
  the nonce.

Known limit: the program runs in the same process as the driver, so a program written
*deliberately against this driver* can find the notary's pipe among its fds and send "pass"
itself, as it can patch `__eq__` to make asserts pass. The design defeats the reward hacks a
policy stumbles on (early exit, printing markers, reading its source, the tests' or the nonce's
files); it is not a proof against an adversary that knows the grader's protocol.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from k2_data.sandbox import SandboxResult, run_python

# runs inside the sandbox as main.py; argv: payload fd (program + tests as JSON), nonce fd
_DRIVER = r"""
import os, sys


def _k2_driver():
    payload_fd, nonce_fd = int(sys.argv[1]), int(sys.argv[2])
    rp, wp = os.pipe()
    notary = os.fork()
    if notary == 0:
        try:
            os.close(wp)
            os.close(payload_fd)
            import ctypes

            if ctypes.CDLL(None).prctl(4, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0),
                                       ctypes.c_ulong(0)) != 0:  # PR_SET_DUMPABLE, 0
                os._exit(3)
            nonce = os.read(nonce_fd, 256)
            os.close(nonce_fd)
            if os.read(rp, 16) == b"pass":
                os.write(1, b"\n" + nonce + b"\n")
        finally:
            os._exit(0)
    os.close(rp)
    os.close(nonce_fd)
    with os.fdopen(payload_fd, "rb") as f:
        payload = f.read()
    import json

    sources = json.loads(payload)
    del payload
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        program = compile(sources.pop("program"), "<program>", "exec")
        tests = compile(sources.pop("tests"), "<tests>", "exec")
        del sources
        exec(program, namespace)
        exec(tests, namespace)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        try:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            sys.stdout.flush()  # keep what the program printed, for debugging
        finally:
            os._exit(1)
    os.write(wp, b"pass")
    os.close(wp)
    os.waitpid(notary, 0)
    os._exit(0)


_k2_driver()
"""


_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def last_code_block(text: str) -> str | None:
    """The last fenced code block of `text` (```python ... ``` or a bare fence), or None."""
    blocks = _FENCE.findall(text or "")
    return blocks[-1] if blocks else None


@dataclass
class UnitTestResult:
    passed: bool
    result: SandboxResult


def run_unit_tests(
    program: str, tests: str, *, timeout_s: float = 10.0, memory_mb: int = 512
) -> UnitTestResult:
    """Run `program` then `tests` (plain asserts) in one namespace in the sandbox; `passed` iff the run
    exited 0 within every limit and the last stdout line is this run's nonce. Raises `SandboxError` when
    the sandbox itself cannot be set up."""
    if not isinstance(program, str) or not isinstance(tests, str):
        raise TypeError("run_unit_tests: program and tests must be str")
    nonce = secrets.token_hex(16)
    payload = json.dumps({"program": program, "tests": tests}).encode()
    res = run_python(_DRIVER, timeout_s=timeout_s, memory_mb=memory_mb, inputs=[payload, nonce.encode()])
    lines = res.stdout.rstrip("\n").rsplit("\n", 1)
    return UnitTestResult(res.ok and not res.stdout_truncated and lines[-1] == nonce, res)


__all__ = ["UnitTestResult", "last_code_block", "run_unit_tests"]
