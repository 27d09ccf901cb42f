"""Circuits: transcoders that replace the MLPs, attribution graphs, interventions read off them.

- :class:`TranscoderSet` (per-layer transcoders) and :class:`CrossLayerTranscoder` replace a
  model's MLPs; :func:`load_transcoders` reads circuit-tracer's and SAELens's folders, ``save``
  writes them. Attached to a model (``TranscoderSet.attach``), a transcoder's features are
  clamped or ablated by :class:`~interp_engine.FeatureWrite` (read at its input, written at its
  output, the error term kept).
- :func:`attribution_graph` (eager backend) computes the direct effects between features, error
  nodes, token embeddings and logits in the frozen-linear replacement model of one prompt, as an
  :class:`AttributionGraph`: pruning, paths, Neuronpedia JSON, HTML and matplotlib views, and
  :meth:`AttributionGraph.steering_spec` to test what it finds on any backend.

The workflow is in ``docs/guides/circuits.md``.
"""

from ._attribute import attribution_graph
from ._formats import load_transcoders
from ._graph import NEURONPEDIA_SCHEMA, AttributionGraph, Node, Path
from ._transcoders import CrossLayerTranscoder, Replacement, TranscoderSet, reconstruct

__all__ = [
    "NEURONPEDIA_SCHEMA",
    "AttributionGraph",
    "CrossLayerTranscoder",
    "Node",
    "Path",
    "Replacement",
    "TranscoderSet",
    "attribution_graph",
    "load_transcoders",
    "reconstruct",
]
