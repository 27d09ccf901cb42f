"""interp-eager: the ``eager`` backend of interp-engine (HF ``transformers`` + PyTorch hooks).

Use it through the core: ``interp_engine.load_model(path, backend="eager")``. To wrap a model
you already hold, use :meth:`EagerModel.from_hf`.
"""

from ._families import FAMILIES, Family, supported_model_types
from ._model import LOAD_OPTIONS, EagerModel

__all__ = ["FAMILIES", "LOAD_OPTIONS", "EagerModel", "Family", "supported_model_types"]
