"""interp_engine.harvest on eager ``interp:tiny``: SAELens's packing (checked against sae-lens's
own), the corpus readers, SAELens's cached-activations output (sae-lens trains from it, and what
its loader reads is what HF transformers computes), the safetensors shards read back lazily,
resume after a real SIGKILL, refusals, readouts and top contexts, and ``interp harvest``."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from interp_engine import (
    HarvestMismatch,
    InsufficientDiskSpace,
    InvalidCorpus,
    InvalidFeatures,
    InvalidOption,
    LayerOutOfRange,
    run_with_cache,
    tiny_model_path,
)
from interp_engine.harvest import feature_html, harvest, open_corpus, open_harvest, pack, top_contexts
from interp_testkit.suite import hf_for

from ..support.harvest import DOCS, TINY_SAE


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


def _sae_lens_rows(docs: list[list[int]], context_size: int, bos: int | None, sep: int | None, one: bool) -> list:
    from sae_lens.tokenization_and_batching import concat_and_batch_sequences

    rows = concat_and_batch_sequences(
        iter(torch.tensor(d, dtype=torch.long) for d in docs),
        context_size=context_size,
        begin_batch_token_id=bos,
        sequence_separator_token_id=sep,
        disable_concat_sequences=one,
    )
    return [r.tolist() for r in rows]


@pytest.mark.parametrize("context_size", [2, 5, 16])
@pytest.mark.parametrize(("bos", "sep"), [(0, 0), (0, None), (None, 7), (None, None), (3, 0)])
def test_packing_is_sae_lens_own(context_size: int, bos: int | None, sep: int | None) -> None:
    gen = torch.Generator().manual_seed(context_size)
    docs = [torch.randint(0, 12, (int(n),), generator=gen).tolist() for n in torch.randint(0, 23, (40,), generator=gen)]
    for packing, one in (("concat", False), ("truncate", True)):
        ours = list(pack(enumerate(docs), context_size=context_size, packing=packing, bos_id=bos, separator_id=sep))
        assert [r.tokens for r in ours] == _sae_lens_rows(docs, context_size, bos, sep, one)
        for row in ours:  # each token's document and position name the token it is
            for token, doc, pos in zip(row.tokens, row.doc, row.pos, strict=True):
                assert pos == -1 or docs[doc][pos] == token


def test_corpus_formats_read_the_same_documents(tmp_path: pathlib.Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("\n".join(DOCS) + "\n")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"body": DOCS}), tmp_path / "a.parquet")
    datasets.Dataset.from_dict({"body": DOCS}).save_to_disk(str(tmp_path / "hf"))
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "1.txt").write_text("\n".join(DOCS[:4]) + "\n")
    (folder / "2.txt").write_text("\n".join(DOCS[4:]) + "\n")
    for source, field in ((tmp_path / "a.txt", "text"), (folder, "text"), (tmp_path / "hf", "body"), (DOCS, "text")):
        assert list(open_corpus(source, text_field=field).documents()) == DOCS, source
    for source in (tmp_path / "a.jsonl", tmp_path / "a.parquet"):
        assert list(open_corpus(source, text_field="body").documents()) == DOCS, source
    ids = [[1, 2, 3], [4, 5]]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps({"tokens": t}) + "\n" for t in ids))
    assert list(open_corpus(tmp_path / "ids.jsonl").documents()) == ids  # SAELens's pre-tokenized column


def test_bad_corpora_are_named(tmp_path: pathlib.Path, direct: Any) -> None:
    with pytest.raises(InvalidCorpus, match="does not exist"):
        open_corpus(tmp_path / "missing.txt")
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(InvalidCorpus, match="cannot tell the format") as info:
        open_corpus(tmp_path / "a.csv")
    assert "jsonl" in info.value.valid
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(InvalidCorpus, match="line 2 is not JSON"):
        list(open_corpus(tmp_path / "bad.jsonl").documents())
    (tmp_path / "field.jsonl").write_text('{"body": "ok"}\n')
    with pytest.raises(InvalidCorpus, match=r"no field 'text'.*body"):
        list(open_corpus(tmp_path / "field.jsonl").documents())
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(InvalidCorpus, match="not a Parquet file"):
        list(open_corpus(tmp_path / "bad.parquet").documents())
    (tmp_path / "empty.jsonl").write_text("")
    out = tmp_path / "out"
    with pytest.raises(InvalidCorpus, match="holds no document"):
        harvest(direct, tmp_path / "empty.jsonl", out, addresses=["resid_post.0"], progress=False)
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(InvalidCorpus, match="gives no row"):
        harvest(direct, tmp_path / "blank.txt", out, addresses=["resid_post.0"], progress=False)


def _sae_lens_cfg(cached: pathlib.Path, **options: Any) -> Any:
    """sae-lens's runner config for four steps of a small SAE on ``blocks.2.hook_resid_post`` of
    the tiny model, read from the harvest's SAELens folder ``cached``."""
    from sae_lens import LanguageModelSAERunnerConfig, StandardTrainingSAEConfig

    return LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=128, d_sae=64),
        model_name="interp:tiny",
        hook_name="blocks.2.hook_resid_post",
        dataset_path=str(cached),
        use_cached_activations=True,
        cached_activations_path=str(cached),
        context_size=16,
        store_batch_size_prompts=4,
        n_batches_in_buffer=2,
        train_batch_size_tokens=32,
        training_tokens=32 * 4,
        device="cpu",
        act_store_device="cpu",
        lr_warm_up_steps=0,
        n_checkpoints=0,
        **options,
    )


def test_saelens_trains_from_the_harvest(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path) -> None:
    """sae-lens's own loader (ActivationsStore, with use_cached_activations) reads the folder, and
    what it reads is what HF transformers computes for those rows; sae-lens's trainer then trains
    an SAE on it for a few steps."""
    import datasets
    from sae_lens import TrainingSAE
    from sae_lens.training.activations_store import ActivationsStore
    from sae_lens.training.sae_trainer import SAETrainer

    out = tmp_path / "out"
    summary = harvest(direct, corpus, out, addresses=["resid_post.2", "resid_post.0"], context_size=16, progress=False)
    assert summary.rows >= 8 and summary.tokens == 16 * summary.rows
    cached = datasets.load_from_disk(str(out / "saelens"))
    assert cached.features["blocks.2.hook_resid_post"] == datasets.Array2D(shape=(16, 128), dtype="float32")
    assert cached.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=16)
    cfg = _sae_lens_cfg(out / "saelens")
    tokens = datasets.Dataset.from_dict({"tokens": cached["token_ids"]})
    store = ActivationsStore.from_config(None, cfg, override_dataset=tokens)  # type: ignore[arg-type]
    acts, token_ids = store.get_raw_llm_batch()
    rows = token_ids.reshape(4, 16)
    hf = hf_for(pathlib.Path(tiny_model_path()))
    with torch.no_grad():
        hidden = hf(rows.long(), output_hidden_states=True).hidden_states[3]  # after block 2
    torch.testing.assert_close(acts, hidden.reshape(-1, 128), rtol=1e-4, atol=1e-4)
    tokenizer = direct.model.tok.tokenizer
    docs = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in DOCS]
    bos = tokenizer.bos_token_id
    assert cached["token_ids"] == _sae_lens_rows(docs, 16, bos, bos, False)  # SAELens's own packing
    store.current_row_idx = 0
    sae = TrainingSAE.from_dict(cfg.get_training_sae_cfg_dict())
    before = sae.W_enc.detach().clone()
    trainer = SAETrainer(cfg=cfg.to_sae_trainer_config(), sae=sae, data_provider=store)
    trainer.fit()
    assert trainer.n_training_steps == 4 and not torch.equal(before, sae.W_enc.detach())


def test_saelens_training_runner_trains_from_the_harvest(
    tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path
) -> None:
    """sae-lens's whole training runner (``LanguageModelSAETrainingRunner``) on a harvested folder
    through its cached-activations option: its store reads the harvest's values (checked against
    HF ``transformers``), it trains and saves an SAE, and ``load_sae`` reads that SAE back. The
    runner wants a TransformerLens model even when it reads cached activations (it never runs it
    then): a tiny ``HookedTransformer`` of the same width stands in, so nothing comes from the hub."""
    import datasets
    from sae_lens import LoggingConfig
    from sae_lens.llm_sae_training_runner import LanguageModelSAETrainingRunner
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from interp_engine import load_sae

    out = tmp_path / "out"
    harvest(direct, corpus, out, addresses=["resid_post.2"], context_size=16, progress=False)
    cached = str(out / "saelens")
    cfg = _sae_lens_cfg(
        pathlib.Path(cached),
        n_eval_batches=0,
        output_path=str(tmp_path / "trained"),
        logger=LoggingConfig(log_to_wandb=False),
    )
    stand_in = HookedTransformer(
        HookedTransformerConfig(n_layers=3, d_model=128, d_head=32, n_ctx=16, d_vocab=1000, act_fn="gelu")
    )
    tokens = datasets.Dataset.from_dict({"tokens": datasets.load_from_disk(cached)["token_ids"]})
    runner = LanguageModelSAETrainingRunner(cfg, override_dataset=tokens, override_model=stand_in)
    store = runner.activations_store
    acts, token_ids = store.get_raw_llm_batch()
    with torch.no_grad():
        hidden = hf_for(pathlib.Path(tiny_model_path()))(token_ids.reshape(4, 16).long(), output_hidden_states=True)
    torch.testing.assert_close(acts, hidden.hidden_states[3].reshape(-1, 128), rtol=1e-4, atol=1e-4)
    store.current_row_idx = 0
    before = runner.sae.W_enc.detach().clone()
    trained = runner.run()
    assert not torch.equal(before, trained.W_enc.detach())
    loaded = load_sae(tmp_path / "trained")
    assert loaded.hook_name == "blocks.2.hook_resid_post"
    torch.testing.assert_close(loaded.W_enc, trained.W_enc.detach())


def test_safetensors_shards_read_back(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path) -> None:
    out = tmp_path / "out"
    harvest(
        direct,
        corpus,
        out,
        addresses=["resid_post.1", "attn_z.0"],
        context_size=16,
        formats=["safetensors"],
        packing="document",
        shard_bytes=4 * 16 * (2 * 128 * 4 + 16),  # four rows a shard
        progress=False,
    )
    ds = open_harvest(out)
    manifest = json.loads((out / "harvest.json").read_text())
    assert len(manifest["shards"]) > 1 and manifest["complete"]
    assert manifest["settings"]["model"]["hash"] and manifest["versions"]["torch"] == torch.__version__
    nonempty = [i for i, d in enumerate(DOCS) if d]
    assert len(ds) == len(nonempty)
    tokenizer = direct.model.tok.tokenizer
    for row_index, doc in enumerate(nonempty):
        row = ds[row_index]
        ids = [tokenizer.bos_token_id, *tokenizer(DOCS[doc], add_special_tokens=False)["input_ids"]][:16]
        assert row.tokens.tolist() == ids and set(row.doc.tolist()) == {doc}
        cache = run_with_cache(direct, ids, ["resid_post.1", "attn_z.0"])  # alone, not padded in a batch
        torch.testing.assert_close(row.values["resid_post.1"], cache["resid_post.1"][0], rtol=1e-5, atol=1e-5)
        expected = cache["attn_z.0"][0].reshape(len(ids), -1)
        torch.testing.assert_close(ds.address("attn_z.0")[row_index], expected, rtol=1e-5, atol=1e-5)
        whole = ds.document(doc)
        assert whole.pos.tolist() == list(range(len(ids) - 1)) and whole.tokens.tolist() == ids[1:]
    assert sum(s.shape[0] for s in ds.address("resid_post.1").shards()) == ds.n_tokens
    del manifest["shards"][1]  # a run stopped with shard 1 not done and shard 2 done (replicas)
    manifest["complete"] = False
    (out / "harvest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidCorpus, match="shards missing before its last one \\(shards 1 of"):
        open_harvest(out)


RESUMED: dict[str, Any] = {
    "addresses": ["resid_post.3"],
    "context_size": 16,
    "batch_rows": 1,
    "shard_bytes": 16 * 2 * (128 * 4 + 4 + 16),  # two rows a shard, in both formats
}


def _script(out: pathlib.Path, corpus: pathlib.Path) -> str:
    return textwrap.dedent(
        f"""
        from interp_engine import load_model
        from interp_engine.harvest import harvest
        model = load_model("interp:tiny", backend="eager")
        harvest(model, {str(corpus)!r}, {str(out)!r}, progress=False, **{RESUMED!r})
        """
    )


@pytest.mark.parametrize("seed", range(4))
def test_shards_are_the_bytes_safetensors_writes(seed: int) -> None:
    """A shard, written from each tensor's pieces without joining them, is byte for byte what
    ``safetensors.torch.save`` gives for the joined tensors: every dtype a shard may hold, empty
    tensors, names outside ASCII, headers of every length modulo 8."""
    import random

    from safetensors.torch import save

    from interp_engine.harvest._shards import SAFETENSORS_DTYPES, safetensors_chunks

    rng = random.Random(seed)
    for _ in range(50):
        whole: dict[str, torch.Tensor] = {}
        pieces: dict[str, Any] = {}
        for j in range(rng.randint(1, 7)):
            name = rng.choice(["resid_post.3", "features:é:top4/ids", "tokens", "x" * rng.randint(1, 9)]) + str(j)
            shape = [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
            dtype = rng.choice(list(SAFETENSORS_DTYPES))
            value = (torch.randn(shape) * 100).to(dtype)
            whole[name] = value
            cut = rng.randint(0, shape[0])
            pieces[name] = [value[:cut], value[cut:]] if rng.random() < 0.5 else value
        assert b"".join(bytes(c) for c in safetensors_chunks(pieces)) == save(whole)


def test_resume_after_sigkill(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path) -> None:
    """Killed (SIGKILL) in the middle of a run, a rerun of the same harvest continues: every row
    once, in order, equal to an uninterrupted run's."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    harvest(direct, corpus, whole, progress=False, **RESUMED)
    proc = subprocess.Popen([sys.executable, "-c", _script(killed, corpus)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            listed = killed / "harvest.json"
            if listed.exists() and len(json.loads(listed.read_text())["shards"]) >= 3:
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the harvest ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    state = json.loads((killed / "harvest.json").read_text())
    total = len(json.loads((whole / "harvest.json").read_text())["shards"])
    assert not state["complete"] and 3 <= len(state["shards"]) < total
    subprocess.run([sys.executable, "-c", _script(killed, corpus)], check=True, stderr=subprocess.DEVNULL)
    a, b = open_harvest(whole), open_harvest(killed)
    assert len(a) == len(b) and a.n_tokens == b.n_tokens
    for row in range(len(a)):
        assert torch.equal(a[row].tokens, b[row].tokens) and torch.equal(a[row].doc, b[row].doc)
        assert torch.equal(a[row].values["resid_post.3"], b[row].values["resid_post.3"])
    assert not list(killed.rglob("*.partial")) and not (killed / "saelens" / ".tmp_shards").exists()
    import datasets

    assert (
        datasets.load_from_disk(str(killed / "saelens"))["token_ids"]
        == datasets.load_from_disk(str(whole / "saelens"))["token_ids"]
    )


def test_refuses_another_harvest_and_bad_input(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path) -> None:
    out = tmp_path / "out"
    harvest(direct, corpus, out, addresses=["resid_post.0"], context_size=8, formats=["safetensors"], progress=False)
    before = (out / "harvest.json").read_bytes()
    with pytest.raises(HarvestMismatch, match="the context size: 8 there, 16 asked") as info:
        harvest(
            direct, corpus, out, addresses=["resid_post.0"], context_size=16, formats=["safetensors"], progress=False
        )
    assert info.value.differences == {"context_size": (8, 16)}
    with pytest.raises(HarvestMismatch, match="the addresses harvested"):
        harvest(
            direct, corpus, out, addresses=["resid_post.1"], context_size=8, formats=["safetensors"], progress=False
        )
    assert (out / "harvest.json").read_bytes() == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(HarvestMismatch, match=r"holds files and no harvest\.json"):
        harvest(direct, corpus, other, addresses=["resid_post.0"], progress=False)
    with pytest.raises(LayerOutOfRange):
        harvest(direct, corpus, tmp_path / "x", addresses=["resid_post.9"], progress=False)
    wide = tmp_path / "sae-mlp"
    shutil.copytree(TINY_SAE, wide)
    cfg = json.loads((wide / "cfg.json").read_text())
    cfg["metadata"]["hook_name"] = "blocks.2.mlp.hook_post"
    (wide / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidFeatures):
        harvest(direct, corpus, tmp_path / "x", saes={"wide": wide}, formats=["safetensors"], progress=False)
    with pytest.raises(InvalidOption, match="rows of different lengths"):
        harvest(direct, corpus, tmp_path / "x", addresses=["resid_post.0"], packing="document", progress=False)
    assert not (tmp_path / "x").exists()


def test_disk_space(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Too little free disk is refused before anything is written; a disk that fills mid-run
    (here: the third shard's write fails with ENOSPC) keeps the shards before it, and the rerun
    completes the harvest."""
    import errno
    from collections import namedtuple

    from interp_engine.harvest import _manifest, _shards

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(_manifest.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    out = tmp_path / "out"
    with pytest.raises(InsufficientDiskSpace, match="needs about") as info:
        harvest(direct, corpus, out, addresses=["resid_post.0"], context_size=8, progress=False)
    assert info.value.free == 1000 and info.value.needed > 1000 and not out.exists()
    monkeypatch.undo()
    real = _shards.atomic_write
    calls = []

    def filling(path: pathlib.Path, chunks: list[bytes | memoryview]) -> None:
        calls.append(path)
        if len(calls) != 3:
            return real(path, chunks)

        def header_then_full() -> Any:
            yield chunks[0]
            raise OSError(errno.ENOSPC, "No space left on device")

        real(path, header_then_full())

    monkeypatch.setattr(_shards, "atomic_write", filling)
    options: dict[str, Any] = {"addresses": ["resid_post.0"], "context_size": 8, "shard_bytes": 8 * 2 * 600}
    with pytest.raises(InsufficientDiskSpace, match="filled while writing shard 2"):
        harvest(direct, corpus, out, formats=["safetensors"], progress=False, **options)
    assert len(json.loads((out / "harvest.json").read_text())["shards"]) == 2
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    monkeypatch.undo()
    summary = harvest(direct, corpus, out, formats=["safetensors"], progress=False, **options)
    assert summary.new_rows == summary.rows - 4 and len(open_harvest(out)) == summary.rows


def test_readouts_and_top_contexts(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path) -> None:
    """Per-token top-k readouts equal the model's own; each feature's kept top contexts are the
    highest of all its values in the readouts, with the tokens around them."""
    from interp_engine import Features

    out = tmp_path / "out"
    harvest(
        direct,
        corpus,
        out,
        saes={"res2": TINY_SAE},
        top_k=4,
        top_contexts=3,
        context_window=2,
        context_size=16,
        formats=["safetensors"],
        batch_rows=3,
        progress=False,
    )
    ds = open_harvest(out)
    key = "features:res2:top4"
    everything = []
    for index in range(len(ds)):
        row = ds[index]
        read = run_with_cache(direct, row.tokens.tolist(), [Features("res2", top_k=4)])[Features("res2", top_k=4)]
        ids, values = row.values[key]
        assert torch.equal(ids, read.ids[0].to(torch.int32)) and torch.equal(values, read.values[0])
        for pos in range(ids.shape[0]):
            everything += [(int(f), float(v), index, pos) for f, v in zip(ids[pos], values[pos], strict=True) if f >= 0]
    kept = top_contexts(out, "res2")["features"]
    for feature in {f for f, *_ in everything}:
        expected = sorted((v for f, v, *_ in everything if f == feature), reverse=True)[:3]
        entries = kept[str(feature)]
        assert [e["value"] for e in entries] == pytest.approx(expected)
        best = entries[0]
        tokens = ds[best["row"]].tokens.tolist()
        assert best["tokens"][2] == tokens[best["position"]]
        assert best["tokens"][:2] == [-1, -1, *tokens][best["position"] : best["position"] + 2]
    page = feature_html(out, "res2", int(next(iter(kept))))
    assert page.startswith("<!doctype html>") and "class='hit'" in page


def test_cli_harvest_show(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path, capsys: Any) -> None:
    """``interp harvest show``: the strongest features, then one feature's contexts (as text with the
    activating token marked, as JSON, as the HTML page), and a one-line error for a feature never kept."""
    from interp_engine.cli import main

    out = tmp_path / "out"
    options: dict[str, Any] = {"top_k": 4, "context_size": 16, "formats": ["safetensors"], "progress": False}
    harvest(direct, corpus, out, saes={"res2": TINY_SAE}, top_contexts=2, context_window=2, **options)
    kept = top_contexts(out, "res2")["features"]
    strongest = max(kept, key=lambda f: kept[f][0]["value"])
    assert main(["harvest", "show", str(out), "--limit", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"res2: {len(kept)} features kept; the strongest (value, feature, its best context):"
    assert len(lines) == 4 and lines[1].split()[:2] == [f"{kept[strongest][0]['value']:.3f}", strongest]
    page = tmp_path / "f.html"
    assert main(["harvest", "show", str(out), "--sae", "res2", "--feature", strongest, "--html", str(page)]) == 0
    lines = capsys.readouterr().out.splitlines()
    entries = kept[strongest]
    assert lines[0] == f"res2 feature {strongest}: top {len(entries)} contexts (value, row:position, [[token]])"
    for line, entry in zip(lines[1:], entries, strict=False):
        value, where, context = line.split(maxsplit=2)
        assert float(value) == pytest.approx(entry["value"], abs=1e-3)
        assert where == f"{entry['row']}:{entry['position']}"
        hit = json.dumps(entry["text"][2])[1:-1]
        assert f"[[{hit}]]" in context
    assert lines[-1] == f"wrote {page}" and page.read_text() == feature_html(out, "res2", int(strongest))
    assert main(["harvest", "show", str(out), "--feature", strongest, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["contexts"] == entries
    never = next(f for f in range(1000) if str(f) not in kept)
    assert main(["harvest", "show", str(out), "--feature", str(never)]) == 1
    assert f"feature {never} of 'res2' never reached a token's top-k" in capsys.readouterr().err
    assert main(["harvest", "show", str(tmp_path)]) == 1
    assert "holds no top contexts" in capsys.readouterr().err


def test_cli_harvest(tmp_path: pathlib.Path, corpus: pathlib.Path) -> None:
    from interp_engine.cli import main

    out = tmp_path / "out"
    args = ["harvest", "interp:tiny", str(corpus), str(out), "--points", "resid_post.1", "--context-size", "8"]
    assert main([*args, "--quiet", "--max-rows", "5"]) == 0
    assert len(open_harvest(out)) == 5
    assert main([*args, "--quiet", "--context-size", "16", "--max-rows", "5"]) == 1


def test_top_contexts_merge_in_shard_order_whatever_order_shards_finish(tmp_path: pathlib.Path) -> None:
    """Shards that finish out of order (Ray replicas) give the top contexts of shards taken in
    order, and a store rebuilt from the shards a manifest lists (with a hole) continues exactly."""
    from interp_engine.harvest._top import TopContexts, TopStore

    gen = torch.Generator().manual_seed(3)
    n_features, n_tok, k = 12, 6, 3
    states = []
    for shard in range(6):
        ids = torch.randint(-1, n_features, (2, n_tok, k), generator=gen)
        values = torch.randint(0, 5, (2, n_tok, k), generator=gen).float()  # ties, kept by the earlier token
        tokens = torch.randint(0, 50, (2, n_tok), generator=gen)
        top = TopContexts(n_features, 3, 1)
        top.update(ids, values, tokens, first_row=2 * shard)
        states.append(top.state())
    in_order = TopStore(tmp_path / "a", {"s": n_features}, 3, 1, set())
    for index, state in enumerate(states):
        in_order.add(index, {"s": state})
        in_order.prune()
    order = [1, 0, 3, 4, 2, 5]
    mixed = TopStore(tmp_path / "b", {"s": n_features}, 3, 1, set())
    for index in order[:4]:  # listed: 1, 0, 3, 4 (shard 2 not done: a hole)
        mixed.add(index, {"s": states[index]})
        mixed.prune()
    assert mixed.prefix == 2 and sorted(mixed.waiting) == [3, 4]
    names = sorted(p.name for p in (tmp_path / "b" / "top" / "s").iterdir())
    assert names == ["after_00002.safetensors", "shard_00003.safetensors", "shard_00004.safetensors"]
    resumed = TopStore(tmp_path / "b", {"s": n_features}, 3, 1, {0, 1, 3, 4})
    for index in order[4:]:
        resumed.add(index, {"s": states[index]})
        resumed.prune()
    assert resumed.prefix == 6 and not resumed.waiting
    for key, value in in_order.merged["s"].state().items():
        assert torch.equal(resumed.merged["s"].state()[key], value), key
    assert sorted(p.name for p in (tmp_path / "b" / "top" / "s").iterdir()) == ["after_00006.safetensors"]
