"""interp-eager: the ``eager`` backend of interp-engine (HF ``transformers`` + PyTorch hooks).

Use it through the core: ``interp_engine.load_model(path, backend="eager")``. To wrap a model
you already hold, use :meth:`EagerModel.from_hf`. The architecture of a model is resolved from
its module tree (``resolve_family(hf_model)``; a loaded model's is ``EagerModel.family``).
"""

from ._families import FAMILY_DATA, Family, supported_model_types
from ._model import LOAD_OPTIONS, EagerModel
from ._resolve import resolve as resolve_family

__all__ = ["FAMILY_DATA", "LOAD_OPTIONS", "EagerModel", "Family", "resolve_family", "supported_model_types"]
