"""The CPU platform that Ray places on logical GPUs (see :mod:`interp_testkit.ray_cpu`).

Imported only by vLLM's platform resolution when the plugin is active (it imports vLLM)."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):
    """vLLM's CPU platform, with one Ray ``GPU`` (a logical one) per worker, as on CUDA."""

    ray_device_key: str = "GPU"
