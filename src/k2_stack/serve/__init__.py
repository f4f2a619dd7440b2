"""`k2 serve`: an OpenAI-compatible server (FastAPI + uvicorn) over k2_model's batched engine.

    from k2_stack.serve import build_bridge, create_app
    app = create_app(build_bridge(None, "tiny"))     # uvicorn.run(app, port=8000)

- `app.py`: routing and OpenAI's error shape
- `chat.py`, `completions.py`: request -> plan (validation, prompt, sampling parameters) and engine
  pieces -> response body or SSE stream, pure functions tested without a server
- `common.py`: the server context the translators read, engine pieces, sampling parameters
- `protocol.py`: pydantic request bodies
- `bridge.py`: the shared `EngineThread`, awaited from asyncio; weight updates between steps
- `guided.py`: tool_choice "required" / named function by structured decoding (llguidance)
"""

from k2_stack.serve.app import create_app
from k2_stack.serve.bridge import EngineBridge, ServeConfig, build_bridge

__all__ = ["EngineBridge", "ServeConfig", "build_bridge", "create_app"]
