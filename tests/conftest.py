"""Fixtures shared by the cross-package tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from k2_ckpt.launch import free_port  # the project's one definition


@contextlib.contextmanager
def _serving(bridge, **app_kw) -> Iterator[tuple[object, str]]:
    """`k2 serve`'s app for `bridge` under uvicorn in a thread on a free loopback port; yields an
    OpenAI client (no retries) and the server's root URL, and stops the server on exit."""
    import openai
    import uvicorn

    from k2_stack.serve import create_app

    port = free_port()
    srv = uvicorn.Server(
        uvicorn.Config(create_app(bridge, **app_kw), host="127.0.0.1", port=port, log_level="warning")
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60), url
    finally:
        srv.should_exit = True
        t.join(10)


@pytest.fixture(scope="session")
def serving():
    """`with serving(bridge, **create_app_kwargs) as (client, url): ...`"""
    return _serving
