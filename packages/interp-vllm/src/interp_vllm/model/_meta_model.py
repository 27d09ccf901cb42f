"""vLLM's model for a path, built in the front-end process without weights (on the meta device):
what :func:`~._resolve.resolve_without_weights` resolves before any engine starts.

A model whose structure cannot be built on the meta device (a value computed at init, such as
ALiBi slopes) is built on the CPU when it is small (:data:`SMALL_MODEL_BYTES`). Building through
vLLM's Transformers modeling backend changes HF's classes for the process's life; the build
undoes that on leaving (:func:`.._compat.hf_classes_kept`), so the caller's own ``transformers`` models
stay plain.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from interp_engine import InvalidOption, UnsupportedArchitecture

from .. import _compat

SMALL_MODEL_BYTES = 2**31
"""A model whose structure cannot be built on the meta device is built on the CPU up to this size."""


def _parameter_bytes(config: Any) -> int | None:
    """The float32 size of an HF config's model (built on the meta device), or ``None``."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    except Exception:
        return None
    return int(4 * sum(p.numel() for p in model.parameters()))


@contextlib.contextmanager
def built_without_weights(path: str, engine_options: dict[str, Any]) -> Iterator[tuple[nn.Module, Any]]:
    """vLLM's model for ``path`` and its HF config, built on the meta device (no weights, no
    memory) in this process, for the ``with`` block; a single-rank process group is set up for
    the build and torn down after. What fails, in the build or in the block, is an
    ``UnsupportedArchitecture`` (``InvalidOption`` for engine arguments vLLM refuses)."""
    import socket

    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    keep = ("trust_remote_code", "revision", "tokenizer", "hf_overrides", "dtype")
    options = {k: v for k, v in engine_options.items() if k in keep}
    try:
        config = EngineArgs(model=path, enforce_eager=True, **options).create_engine_config()
    except Exception as exc:
        if "not supported" not in str(exc) and any(name in str(exc) for name in options):
            raise InvalidOption(  # an engine argument vLLM refuses (a dtype it does not know ...)
                f"vLLM refuses the engine arguments for {path!r}: {type(exc).__name__}: {str(exc)[:600]}"
            ) from exc
        raise UnsupportedArchitecture(
            f"vLLM cannot build a config for {path!r}: {type(exc).__name__}: {str(exc)[:600]}"
        ) from exc
    # vLLM's layers ask the tensor-parallel group for their shard: a group of one, for the build
    # (unless this process already has one: vLLM in-process)
    owned = not (dist.is_initialized() or parallel_state.model_parallel_is_initialized())  # type: ignore[no-untyped-call]
    try:
        with set_current_vllm_config(config), _compat.hf_classes_kept(config.model_config.hf_config):
            if owned:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                parallel_state.init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                    backend="gloo",
                )
                parallel_state.initialize_model_parallel(1, 1)
            try:
                with torch.device("meta"):
                    model = initialize_model(vllm_config=config)
            except (NotImplementedError, RuntimeError) as exc:  # a value computed at init (ALiBi slopes)
                size = _parameter_bytes(config.model_config.hf_config)
                if size is None or size > SMALL_MODEL_BYTES:
                    raise UnsupportedArchitecture(
                        f"vLLM's {path!r} model cannot be built without weights to resolve its structure "
                        f"({type(exc).__name__}: {str(exc)[:200]}), and it is too large to build on the CPU"
                    ) from exc
                config = EngineArgs(model=path, enforce_eager=True, **options).create_engine_config()
                with set_current_vllm_config(config):  # a fresh config: the failed build registered its layers
                    model = initialize_model(vllm_config=config)  # small: built for real, then dropped
            yield model, config.model_config.hf_config
    except UnsupportedArchitecture:
        raise
    except Exception as exc:
        raise UnsupportedArchitecture(
            f"vLLM cannot build {path!r} here: {type(exc).__name__}: {str(exc)[:500]}"
        ) from exc
    finally:
        if owned:
            parallel_state.destroy_model_parallel()  # type: ignore[no-untyped-call]
            parallel_state.destroy_distributed_environment()  # type: ignore[no-untyped-call]
