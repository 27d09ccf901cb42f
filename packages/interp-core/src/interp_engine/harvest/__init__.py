"""Harvest: a model's activations and SAE readouts over a whole corpus, written to disk.

from interp_engine.harvest import harvest, open_harvest

harvest(model, "corpus.jsonl", "out/", addresses=["resid_post.2"], context_size=128)
# out/saelens: SAELens's cached-activations folder (cached_activations_path=out/saelens)
# out/shards + out/harvest.json: safetensors shards and their manifest
ds = open_harvest("out/")      # lazy: ds[row], ds.document(d), ds.address("resid_post.2")

harvest("model/folder", "corpus.jsonl", "/shared/out/", addresses=["resid_post.2"], replicas=4, backend="vllm")
# the same folder, written by 4 replicas of the model on a Ray cluster

Corpus readers (:mod:`._corpus`), SAELens's packing (:mod:`._pack`), the driver
(:mod:`._run`), a shard's work on a model (:mod:`._work`), Ray replicas (:mod:`._replicas`),
the two outputs (:mod:`._saelens`, :mod:`._shards`), the manifest that makes a run resumable
(:mod:`._manifest`) and each feature's top contexts (:mod:`._top`, :mod:`._html`).
"""

from __future__ import annotations

from ._corpus import FORMATS as CORPUS_FORMATS
from ._corpus import Corpus, open_corpus
from ._html import feature_html, top_contexts
from ._pack import PACKINGS, Row, pack
from ._run import FORMATS, HarvestSummary, harvest
from ._shards import AddressView, HarvestDataset, HarvestRow, open_harvest

__all__ = [
    "CORPUS_FORMATS",
    "FORMATS",
    "PACKINGS",
    "AddressView",
    "Corpus",
    "HarvestDataset",
    "HarvestRow",
    "HarvestSummary",
    "Row",
    "feature_html",
    "harvest",
    "open_corpus",
    "open_harvest",
    "pack",
    "top_contexts",
]
