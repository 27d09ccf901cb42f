"""A toy interp-engine backend: character tokens and a few tanh layers, no transformers."""

from .model import ToyModel

__all__ = ["ToyModel"]
