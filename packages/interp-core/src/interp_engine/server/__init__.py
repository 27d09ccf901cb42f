"""An HTTP API over any backend's model (FastAPI; install the extra: ``interp-core[serve]``).

from interp_engine.server import ServerLimits, run

run("path/to/model", backend="eager", port=8000)          # uvicorn on 127.0.0.1:8000

``create_app(model_or_path, ...)`` returns the FastAPI app to mount or run yourself. Endpoints
live under ``/v1/``; the OpenAPI schema is at ``/openapi.json`` and the docs at ``/docs``.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
    import pydantic  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"interp_engine.server needs the 'serve' extra ({exc.name} is missing): pip install 'interp-core[serve]'"
    ) from exc

from ._app import create_app, run
from ._limits import ServerLimits

__all__ = ["ServerLimits", "create_app", "run"]
