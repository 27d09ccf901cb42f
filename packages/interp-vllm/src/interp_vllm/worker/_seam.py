"""Which implementation of the runner seam (:mod:`._runner`) serves which of vLLM's runners:
:func:`install` wraps every runner the installed vLLM has, :func:`seam_of` finds the one serving
a runner instance."""

from __future__ import annotations

from typing import Any

from interp_engine import IncompatibleDependency

from ._runner import RunnerSeam, TapsHandlers
from ._runner_v1 import V1
from ._runner_v2 import V2


def seams() -> tuple[RunnerSeam, ...]:
    """Every runner implementation, V2 first."""
    return (V2, V1)


def install(handlers: TapsHandlers) -> list[str]:
    """Wrap every runner the installed vLLM has. Returns why a runner could not be wrapped (one
    message each; empty where all were)."""
    problems = []
    for seam in seams():
        if not seam.available():
            continue
        try:
            seam.install(handlers)
        except IncompatibleDependency as exc:
            problems.append(str(exc))
        except Exception as exc:  # importing the runner failed: vLLM runs on, unwrapped by this seam
            problems.append(f"vLLM's {seam.name} model runner could not be wrapped: {type(exc).__name__}: {exc}")
    return problems


def seam_of(runner: Any) -> RunnerSeam | None:
    """The implementation serving ``runner`` (``None``: a runner none of them wrapped)."""
    for seam in seams():
        if seam.available() and seam.serves(runner):
            return seam
    return None


__all__ = ["install", "seam_of", "seams"]
