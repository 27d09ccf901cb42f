"""An HTTP API over any backend's model (FastAPI; install the extra: ``interp-core[serve]``).

from interp_engine.server import ServerLimits, run

run("path/to/model", backend="eager", port=8000)          # uvicorn on 127.0.0.1:8000

``create_app(model_or_path, ...)`` returns the FastAPI app to mount or run yourself (with
uvicorn through ``uvicorn_config(app)`` to keep the connection bounds). Endpoints live under
``/v1/`` (``/v1/completions`` is OpenAI's), Prometheus metrics at ``/metrics``; the OpenAPI schema
is at ``/openapi.json`` and the docs at ``/docs``. With ``api_key=`` every request but
``/v1/health`` sends ``Authorization: Bearer <key>``; ``run`` refuses a non-loopback host without
one (``insecure_no_auth=True`` to insist). Every body, prompt, result and wait is bounded by
:class:`ServerLimits`; no client input gives a 5xx; errors come in one JSON shape.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import pydantic  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"interp_engine.server needs the 'serve' extra ({exc.name} is missing): pip install 'interp-core[serve]'"
    ) from exc

from ._app import create_app
from ._guard import LOOPBACK_HOSTS, uvicorn_config
from ._limits import ServerLimits
from ._run import run

__all__ = ["LOOPBACK_HOSTS", "ServerLimits", "create_app", "run", "uvicorn_config"]
