"""A stand-in inference engine per rank, for the tests and the benchmark.

Each training rank forks one engine process holding an `nn.Module` built from a spec
({HF name: (dtype, shape)}), driven over a ZMQ ROUTER control socket, the way an engine's
RPC (vLLM's `collective_rpc`) would drive it: "update" runs `update_weights_from_ipc`,
"digest" returns a BLAKE2b digest of every tensor's bytes (bitwise verification without
shipping the tensors), "fault" arms an injected failure for the next update.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Mapping

import torch
import zmq
from torch import nn

from k2_ckpt.adapters.module import ModuleAdapter
from k2_ckpt.device import device_id
from k2_ckpt.dtypes import FLOAT8, as_bytes, dtype_from_name
from k2_ckpt.worker import update_weights_from_ipc

Spec = dict[str, tuple[str, list[int]]]


def digest(t: torch.Tensor) -> str:
    b = as_bytes(t.detach().contiguous().cpu())
    return hashlib.blake2b(memoryview(b.numpy()), digest_size=16).hexdigest()


def make_tensor(name: str, dtype: str, shape: list[int], version: int) -> torch.Tensor:
    """Deterministic pseudo-random tensor for (name, version)."""
    seed = (
        int.from_bytes(hashlib.blake2b(f"{name}@{version}".encode(), digest_size=8).digest(), "little") >> 1
    )
    g = torch.Generator().manual_seed(seed)
    dt = dtype_from_name(dtype)
    if dt.is_floating_point:
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        return (x.clamp(-400, 400) if dt in FLOAT8 else x).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 100, shape, generator=g, dtype=dt)


def build_module(spec: Spec, device: torch.device | str = "cpu") -> nn.Module:
    """An nn.Module whose parameters carry exactly the spec's dotted names, filled with zeros."""
    root = nn.Module()
    for name, (dtype, shape) in spec.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(
            leaf,
            nn.Parameter(
                torch.zeros(shape, dtype=dtype_from_name(dtype), device=device), requires_grad=False
            ),
        )
    return root


class _FaultyLoader:
    """Wraps a loader; on the armed tensor: raise, die (os._exit) or hang."""

    def __init__(self, inner: ModuleAdapter, mode: str, tensor: str, hang_s: float = 3600.0):
        self.inner, self.mode, self.tensor, self.hang_s = inner, mode, tensor, hang_s

    def validate(self, name, dtype, shape):
        if name == self.tensor:
            if self.mode == "raise":
                raise RuntimeError(f"injected failure while loading {name}")
            if self.mode == "die":
                os._exit(17)
            if self.mode == "hang":
                time.sleep(self.hang_s)
        self.inner.validate(name, dtype, shape)

    def load_weights(self, named):
        self.inner.load_weights(named)

    def post_load(self):
        self.inner.post_load()


def control_address(run_dir: str, rank: int) -> str:
    return f"ipc://{os.path.join(run_dir, f'engine-{rank}.ctl')}"


def _engine_main(
    rank: int, spec: Spec, ctl: str, staged: bool, timeout_s: float, assign: bool, device: str = "cpu"
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    module = build_module(spec, dev)
    adapter = ModuleAdapter(module, assign=assign)
    me = device_id(dev, rank)  # the GPU's UUID on CUDA: the same key the rank's server computes
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(ctl)
    fault: tuple[str, str] | None = None
    while True:
        ident, _, raw = sock.recv_multipart()
        cmd, kw = pickle.loads(raw)
        try:
            if cmd == "update":
                loader = _FaultyLoader(adapter, *fault) if fault else adapter
                fault = None
                res = update_weights_from_ipc(
                    kw["zmq_handles"][me],
                    loader,
                    device=dev,
                    device_id=me,
                    staged=staged,
                    timeout_s=timeout_s,
                    zmq_ctx=ctx,
                )
                reply = ("ok", res.tensors)
            elif cmd == "ping":
                reply = ("ok", me)
            elif cmd == "digest":
                reply = ("ok", {n: digest(t) for n, t in module.state_dict().items()})
            elif cmd == "mode":
                staged = bool(kw["staged"])
                reply = ("ok", None)
            elif cmd == "fault":
                fault = (kw["mode"], kw["tensor"], float(kw.get("hang_s", 3600.0)))
                reply = ("ok", None)
            elif cmd == "exit":
                sock.send_multipart([ident, b"", pickle.dumps(("ok", None))])
                break
            else:
                reply = ("error", f"unknown command {cmd!r}")
        except Exception:
            reply = ("error", traceback.format_exc())
        sock.send_multipart([ident, b"", pickle.dumps(reply)])
    sock.close(linger=100)
    ctx.term()


def call(ctl: str, cmd: str, timeout_s: float = 60.0, **kw) -> tuple[str, object]:
    """One request to an engine's control socket."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ctl)
    try:
        s.send(pickle.dumps((cmd, kw)))
        if not s.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"engine at {ctl} did not answer {cmd!r} within {timeout_s}s")
        return pickle.loads(s.recv())
    finally:
        s.close()


class EngineProcess:
    """The rank's colocated engine. On CPU it is forked (start it before `init_process_group`:
    no threads yet); on CUDA it is spawned (a forked child cannot use CUDA) and receives
    through CUDA IPC, like a vLLM worker on the same GPU."""

    def __init__(
        self,
        rank: int,
        spec: Spec,
        run_dir: str,
        *,
        staged: bool = True,
        timeout_s: float = 60.0,
        assign: bool = False,
        device: str = "cpu",
    ):
        self.rank, self.ctl = rank, control_address(run_dir, rank)
        method = "spawn" if torch.device(device).type == "cuda" else "fork"
        self.proc = mp.get_context(method).Process(
            target=_engine_main, args=(rank, spec, self.ctl, staged, timeout_s, assign, device), daemon=True
        )
        self.proc.start()

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """Block until the engine answers (a spawned CUDA engine takes seconds); its device id."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.proc.is_alive():
                raise RuntimeError(
                    f"engine {self.rank} exited with code {self.proc.exitcode} before it was ready"
                )
            try:
                return self.call("ping", timeout_s=min(5.0, max(0.1, deadline - time.monotonic())))  # type: ignore[return-value]
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {self.rank} not ready within {timeout_s:.0f}s") from None

    def call(self, cmd: str, timeout_s: float = 60.0, **kw) -> object:
        status, value = call(self.ctl, cmd, timeout_s, **kw)
        if status != "ok":
            raise RuntimeError(f"engine {self.rank} failed {cmd!r}:\n{value}")
        return value

    def digests(self) -> dict[str, str]:
        return self.call("digest")  # type: ignore[return-value]

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                call(self.ctl, "exit", timeout_s=2)
            except Exception:
                pass
            self.proc.join(2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


def engines_req_func(
    run_dir: str, world_size: int, timeout_s: float = 120.0, device_ids: list[str] | None = None
):
    """req_func for rank 0: ask every engine (concurrently) to run `update_weights_from_ipc`.

    `device_ids[r]` is rank r's device id (default: the CPU ids; on CUDA, gather
    `ParameterServer.device_id` from every rank)."""
    ids = device_ids or [device_id(torch.device("cpu"), r) for r in range(world_size)]
    ctls = {ids[r]: control_address(run_dir, r) for r in range(world_size)}

    def req(zmq_handles: Mapping[str, str]) -> list[tuple[str, object]]:
        ctx = zmq.Context.instance()
        socks = []
        for dev in zmq_handles:
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ctls[dev])
            s.send(pickle.dumps(("update", {"zmq_handles": dict(zmq_handles)})))
            socks.append(s)
        out = []
        deadline = time.monotonic() + timeout_s
        for s in socks:
            if s.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                out.append(pickle.loads(s.recv()))
            else:
                out.append(("timeout", None))
            s.close()
        return out

    return req


def host_digests(server, name: str) -> dict[str, str]:
    """Digests of this rank's registered bytes for checkpoint `name` (the ground truth)."""
    ck = server._ckpts[name]
    return {
        m.name: hashlib.blake2b(memoryview(ck.bytes_by_name[m.name].numpy()), digest_size=16).hexdigest()
        for m in ck.metas
    }


__all__ = ["EngineProcess", "engines_req_func", "make_tensor", "build_module", "digest", "host_digests"]
