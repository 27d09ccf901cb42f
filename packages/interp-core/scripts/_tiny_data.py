"""The data the dictionaries shipped with ``interp:tiny`` are trained on (``train_tiny_sae.py``,
``train_tiny_transcoders.py``): the tiny model's training corpus, held-out documents from the
corpus generator with another seed, and the activations of every token of a list of documents.

Not part of the installed package; the scripts beside it import it.
"""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from interp_engine import run_with_cache

HERE = pathlib.Path(__file__).resolve().parent
CORPUS = HERE / "tiny_corpus.txt"
"""The tiny model's own training corpus: 1,200 documents, one a line, about 64,000 tokens."""
HELD_OUT_SEED = 1005
"""Seed of the held-out documents (the corpus itself is seed 5; the tests use yet others)."""
HELD_OUT_DOCS = 300
BATCH = 64
"""Documents captured per forward."""


def corpus_generator() -> ModuleType:
    """``make_tiny_corpus.py`` beside this module, as a module (its tables and ``documents``)."""
    spec = importlib.util.spec_from_file_location("make_tiny_corpus", HERE / "make_tiny_corpus.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {HERE / 'make_tiny_corpus.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def corpus_documents() -> list[str]:
    """The training corpus's documents."""
    return CORPUS.read_text(encoding="utf-8").splitlines()


def held_out_documents(generator: ModuleType | None = None) -> list[str]:
    """:data:`HELD_OUT_DOCS` documents the corpus generator writes with :data:`HELD_OUT_SEED`."""
    generator = generator or corpus_generator()
    return list(generator.documents(HELD_OUT_DOCS, seed=HELD_OUT_SEED))


def capture_rows(model: Any, rows: Sequence[Sequence[int]], points: Sequence[str]) -> dict[str, list[torch.Tensor]]:
    """Each of ``points`` (float32) on every token of ``rows`` (token ids, one document a row):
    ``{point: [one [n_tokens, width] tensor per row]}``, padding left out."""
    acts: dict[str, list[torch.Tensor]] = {point: [] for point in points}
    for at in range(0, len(rows), BATCH):
        batch = [list(row) for row in rows[at : at + BATCH]]
        cache = run_with_cache(model, batch, list(points))
        lengths = cache.lengths if cache.lengths is not None else torch.tensor([len(row) for row in batch])
        for point in points:
            value = cache[point].float()
            acts[point].extend(value[i, : int(n)] for i, n in enumerate(lengths))
    return acts
