"""HTTP API (FastAPI + uvicorn, Unix socket or loopback TCP) for the parameter server and receivers.

Every training rank serves its own `ParameterServer` API; a controller calls all ranks at once
(`CkptClient` fans out), since register is per rank and gather-metas/update are collectives.
Errors are JSON `{"error": kind, "message": ..., ...}` with a 4xx/5xx status:

    404 unknown checkpoint / missing file      409 exists, or dtype/shape mismatch at a receiver
    422 bad request body or bad file           502 receiver error      504 receiver dead or timed out

The receiver app (`make_receiver_app`) is the inference side's endpoint that `req_func`
calls: `POST /v1/update_weights_from_ipc {"zmq_handles": {...}}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from k2_ckpt.errors import CkptError, UpdateError
from k2_ckpt.server import ParameterServer
from k2_ckpt.types import TensorMeta
from k2_ckpt.worker import WeightLoader, update_weights_from_ipc

# ---- request / response models ----


class RegisterFilesRequest(BaseModel):
    files: list[str] = Field(min_length=1, description="safetensors files of this rank's shard")


class RegisterResponse(BaseModel):
    checkpoint: str
    rank: int
    tensors: int
    nbytes: int


class MetasResponse(BaseModel):
    checkpoint: str
    metas: list[TensorMeta]


class UpdateRequest(BaseModel):
    update_urls: list[str] = Field(
        default_factory=list, description="receiver endpoints to POST the ZMQ handles to"
    )
    update_uds: list[str] = Field(
        default_factory=list, description="receiver Unix sockets (path), same route"
    )
    ranks: list[int] | None = Field(default=None, description="receivers to update; null = all (broadcast)")
    timeout_s: float | None = Field(default=None, gt=0)


class UpdateResponse(BaseModel):
    checkpoint: str
    seconds: float
    nbytes: int
    gbps: float
    num_buckets: int
    bucket_bytes: int


class HealthResponse(BaseModel):
    status: str = "ok"
    rank: int
    world_size: int
    checkpoints: list[str]


class ReceiverUpdateRequest(BaseModel):
    zmq_handles: dict[str, str]


class ReceiverUpdateResponse(BaseModel):
    checkpoint: str
    tensors: int
    buckets: int
    seconds: float


def _error_response(e: Exception) -> JSONResponse:
    if isinstance(e, UpdateError):
        body = {
            "error": "update_failed",
            "message": str(e),
            "failures": [dataclasses.asdict(f) for f in e.failures],
            "applied": {str(k): v for k, v in e.applied.items()},
        }
        return JSONResponse(body, status_code=e.status)
    if isinstance(e, CkptError):
        return JSONResponse({"error": type(e).__name__, "message": str(e)}, status_code=e.status)
    if isinstance(e, ValueError):
        return JSONResponse({"error": type(e).__name__, "message": str(e)}, status_code=422)
    return JSONResponse({"error": type(e).__name__, "message": str(e)}, status_code=500)


def http_req_func(
    urls: list[str], uds: list[str], timeout_s: float = 600.0
) -> Callable[[dict[str, str]], None]:
    """req_func that POSTs the handles to every receiver endpoint concurrently. It raises at the
    first receiver that cannot be reached or answers an error (the others are left running: the
    failed update aborts them), so the servers learn of it while they are still waiting."""

    def req(zmq_handles: dict[str, str]) -> None:
        targets = [(u, None) for u in urls] + [("http://receiver", p) for p in uds]
        if not targets:  # fails the update on every rank (a req_func failure), instead of a timeout
            raise ValueError(
                "no receivers to call: the update request gave neither update_urls nor update_uds"
            )
        results: queue.Queue[str | None] = queue.Queue()

        def one(url: str, sock: str | None) -> None:
            try:
                transport = httpx.HTTPTransport(uds=sock) if sock else None
                with httpx.Client(transport=transport, timeout=timeout_s) as c:
                    r = c.post(
                        url.rstrip("/") + "/v1/update_weights_from_ipc", json={"zmq_handles": zmq_handles}
                    )
            except Exception as e:  # unreachable receiver: fail the update now, not at its timeout
                results.put(f"{sock or url}: {type(e).__name__}: {e}")
                return
            results.put(
                f"{sock or url}: HTTP {r.status_code} {r.text[:500]}" if r.status_code >= 400 else None
            )

        for t in targets:
            threading.Thread(target=one, args=t, daemon=True).start()
        for _ in targets:
            error = results.get()
            if error is not None:
                raise RuntimeError("receiver call failed: " + error)

    return req


def _install_error_handlers(app: FastAPI) -> None:
    async def handler(request: Request, e: Exception) -> JSONResponse:
        return _error_response(e)

    async def bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        where = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        return JSONResponse(
            {"error": "bad_request", "message": where, "detail": jsonable_encoder(e.errors())},
            status_code=422,
        )

    for exc in (
        CkptError,
        ValueError,
        KeyError,
        TimeoutError,
        RuntimeError,
        OSError,
    ):  # OSError: /dev/shm full
        app.add_exception_handler(exc, handler)
    app.add_exception_handler(RequestValidationError, bad_request)


def make_server_app(ps: ParameterServer) -> FastAPI:
    """The parameter server's API. All server calls run on one thread, in arrival order, so
    collectives are issued in the same order on every rank."""
    app = FastAPI(title="k2-ckpt parameter server", version="0.1.0")
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k2ckpt-api")

    async def run(fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args, **kw))

    _install_error_handlers(app)

    @app.get("/v1/healthz", response_model=HealthResponse)
    async def health() -> HealthResponse:
        return HealthResponse(rank=ps.rank, world_size=ps.world_size, checkpoints=ps.checkpoints())

    @app.post("/v1/checkpoints/{name}/files", response_model=RegisterResponse)
    async def register_files(name: str, req: RegisterFilesRequest) -> RegisterResponse:
        metas = await run(ps.register_checkpoint, name, files=req.files)
        return RegisterResponse(
            checkpoint=name, rank=ps.rank, tensors=len(metas), nbytes=sum(m.nbytes for m in metas)
        )

    @app.post("/v1/checkpoints/{name}/gather-metas", response_model=MetasResponse)
    async def gather(name: str) -> MetasResponse:
        return MetasResponse(checkpoint=name, metas=await run(ps.gather_metas, name))

    @app.post("/v1/checkpoints/{name}/update", response_model=UpdateResponse)
    async def update(name: str, req: UpdateRequest) -> UpdateResponse:
        req_func = http_req_func(req.update_urls, req.update_uds)
        st = await run(ps.update, name, req_func, req.ranks, timeout_s=req.timeout_s)
        return UpdateResponse(
            checkpoint=name,
            seconds=st.seconds,
            nbytes=st.nbytes,
            gbps=st.gbps,
            num_buckets=st.num_buckets,
            bucket_bytes=st.bucket_bytes,
        )

    @app.delete("/v1/checkpoints/{name}")
    async def delete(name: str) -> dict:
        await run(ps.unregister_checkpoint, name)
        return {"checkpoint": name, "rank": ps.rank, "deleted": True}

    return app


def make_receiver_app(
    loader: WeightLoader,
    device_id: str,
    *,
    staged: bool = True,
    timeout_s: float = 300.0,
    device: str | None = None,
) -> FastAPI:
    """The inference side: one update at a time, into `loader`."""
    app = FastAPI(title="k2-ckpt receiver", version="0.1.0")
    lock = threading.Lock()

    _install_error_handlers(app)

    @app.get("/v1/healthz")
    async def health() -> dict:
        return {"status": "ok", "device_id": device_id}

    @app.post("/v1/update_weights_from_ipc", response_model=ReceiverUpdateResponse | None)
    def receive(req: ReceiverUpdateRequest) -> ReceiverUpdateResponse | None:
        if device_id not in req.zmq_handles:
            return None  # this update is for other receivers (ranks=[...])
        with lock:
            res = update_weights_from_ipc(
                req.zmq_handles[device_id],
                loader,
                device=device,
                device_id=device_id,
                staged=staged,
                timeout_s=timeout_s,
            )
        return ReceiverUpdateResponse(
            checkpoint=res.checkpoint, tensors=res.tensors, buckets=res.buckets, seconds=res.seconds
        )

    return app


class BackgroundServer:
    """uvicorn in a daemon thread, on a Unix socket (`uds`) or loopback TCP (`port`)."""

    def __init__(self, app: FastAPI, *, uds: str | None = None, host: str = "127.0.0.1", port: int = 0):
        cfg = uvicorn.Config(app, uds=uds, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="k2ckpt-uvicorn")

    def start(self, timeout_s: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class CkptClient:
    """Calls every rank's API concurrently (Unix sockets or base URLs); returns per-rank JSON."""

    def __init__(self, uds: list[str] | None = None, urls: list[str] | None = None, timeout_s: float = 600.0):
        self.targets = [(p, "http://ckpt") for p in (uds or [])] + [(None, u) for u in (urls or [])]
        self.timeout_s = timeout_s

    def _all(self, method: str, path: str, json: dict | None = None) -> list[httpx.Response]:
        out: list = [None] * len(self.targets)

        def one(i: int, sock: str | None, base: str) -> None:
            transport = httpx.HTTPTransport(uds=sock) if sock else None
            with httpx.Client(transport=transport, timeout=self.timeout_s) as c:
                out[i] = c.request(method, base + path, json=json)

        threads = [threading.Thread(target=one, args=(i, s, b)) for i, (s, b) in enumerate(self.targets)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def register_files(self, name: str, files_per_rank: list[list[str]]) -> list[httpx.Response]:
        out: list = [None] * len(self.targets)

        def one(i: int) -> None:
            sock, base = self.targets[i]
            transport = httpx.HTTPTransport(uds=sock) if sock else None
            with httpx.Client(transport=transport, timeout=self.timeout_s) as c:
                out[i] = c.post(f"{base}/v1/checkpoints/{name}/files", json={"files": files_per_rank[i]})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(self.targets))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def gather_metas(self, name: str) -> list[httpx.Response]:
        return self._all("POST", f"/v1/checkpoints/{name}/gather-metas")

    def update(self, name: str, **body) -> list[httpx.Response]:
        return self._all("POST", f"/v1/checkpoints/{name}/update", json=body)

    def delete(self, name: str) -> list[httpx.Response]:
        return self._all("DELETE", f"/v1/checkpoints/{name}")

    def health(self) -> list[httpx.Response]:
        return self._all("GET", "/v1/healthz")
