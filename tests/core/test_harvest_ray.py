"""``harvest(..., replicas=2)``: two single-CPU replicas of eager ``interp:tiny`` on a local Ray
cluster (``ray start --head`` on loopback, as a cluster's head node starts) write the rows, the
manifest, SAELens's cache and the top contexts of a one-process run, count the tokens each did,
and resume exactly after the driver stops mid-run, whichever replicas wrote the shards before.

One cluster and two replica runs (each run starts its replicas: about ten seconds here); the
corpus is a few hundred tokens, two rows a shard."""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import InvalidOption
from interp_engine.harvest import harvest, open_harvest, top_contexts
from interp_testkit.ray_cluster import local_ray_cluster

from ..support.harvest import DOCS, TINY_SAE

OPTIONS: dict[str, Any] = {
    "addresses": ["resid_post.1"],
    "saes": {"res2": str(TINY_SAE)},
    "top_k": 4,
    "top_contexts": 3,
    "context_size": 16,
    "batch_rows": 2,
    "shard_bytes": 2 * 16 * (2 * (128 * 4) + 4 + 16 + 8 * 4),  # two rows a shard, in both formats
    "progress": False,
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The cluster's address, which this process (the driver) has joined on loopback (a harvest
    uses the cluster its process joined)."""
    import ray
    from ray._private import ray_constants

    with local_ray_cluster(num_cpus=2) as address, pytest.MonkeyPatch.context() as patch:
        # what LOOPBACK_ENV gives the cluster's processes, for this one, which imported ray before
        # the variable could be set: its own address is loopback, as the cluster's node is
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        ray.init(address=address, log_to_driver=False)
        try:
            yield address
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


def _shards(folder: pathlib.Path) -> list[dict[str, Any]]:
    manifest = json.loads((folder / "harvest.json").read_text())
    assert manifest["complete"]
    return list(manifest["shards"])


def _assert_same_harvest(a: pathlib.Path, b: pathlib.Path) -> None:
    """``b`` holds ``a``'s rows in ``a``'s order, its shards and top contexts."""
    import datasets

    strip = ("replica", "node")
    assert [{k: v for k, v in s.items() if k not in strip} for s in _shards(b)] == [
        {k: v for k, v in s.items() if k not in strip} for s in _shards(a)
    ]
    one, two = open_harvest(a), open_harvest(b)
    assert len(one) == len(two) and one.n_tokens == two.n_tokens
    for index in range(len(one)):
        x, y = one[index], two[index]
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.doc, y.doc) and torch.equal(x.pos, y.pos)
        # a replica runs on one thread (Ray's num_cpus=1), this process on two: the same sums, up to float order
        torch.testing.assert_close(y.values["resid_post.1"], x.values["resid_post.1"], rtol=1e-5, atol=1e-5)
        ids_x, values_x = x.values["features:res2:top4"]
        ids_y, values_y = y.values["features:res2:top4"]
        assert torch.equal(ids_x, ids_y)
        torch.testing.assert_close(values_y, values_x, rtol=1e-5, atol=1e-5)
    cache_a, cache_b = datasets.load_from_disk(str(a / "saelens")), datasets.load_from_disk(str(b / "saelens"))
    assert cache_a["token_ids"] == cache_b["token_ids"]
    hook = "blocks.1.hook_resid_post"
    torch.testing.assert_close(
        torch.tensor(cache_b[hook]), torch.tensor(cache_a[hook]), rtol=1e-5, atol=1e-5
    )  # SAELens's cache: the same rows
    top_a, top_b = top_contexts(a, "res2")["features"], top_contexts(b, "res2")["features"]
    assert top_a.keys() == top_b.keys()
    for feature, entries in top_a.items():
        assert [(e["row"], e["position"], e["tokens"]) for e in top_b[feature]] == [
            (e["row"], e["position"], e["tokens"]) for e in entries
        ]


def test_two_replicas_write_a_one_process_harvest_and_resume(
    tmp_path: pathlib.Path,
    direct: Any,
    corpus: pathlib.Path,
    cluster: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from interp_engine.harvest import _run

    one = tmp_path / "one"
    harvest(direct, corpus, one, **OPTIONS)
    assert len(_shards(one)) >= 6
    # two replicas, the driver stopped when it lists the third shard (the shards sent on are cut off)
    two = tmp_path / "two"
    real = _run.write_manifest
    writes = []

    def stopping(folder: pathlib.Path, manifest: Any) -> None:
        writes.append(len(manifest["shards"]))
        if len(manifest["shards"]) == 3:
            raise KeyboardInterrupt
        real(folder, manifest)

    monkeypatch.setattr(_run, "write_manifest", stopping)
    with pytest.raises(KeyboardInterrupt):
        harvest("interp:tiny", corpus, two, replicas=2, backend="eager", ray_address=cluster, **OPTIONS)
    monkeypatch.undo()
    stopped = json.loads((two / "harvest.json").read_text())
    assert not stopped["complete"] and len(stopped["shards"]) == 2
    assert {s["replica"] for s in stopped["shards"]} <= {0, 1}
    # resumed by one process (the shards the replicas wrote are skipped) ...
    alone = tmp_path / "alone"
    shutil.copytree(two, alone)
    resumed = harvest(direct, corpus, alone, **OPTIONS)
    assert resumed.replica_tokens == (resumed.new_tokens,) and resumed.rows - resumed.new_rows == 4
    _assert_same_harvest(one, alone)
    # ... and by two replicas (the same harvest on the command line): shard k on replica k mod 2,
    # the tokens each did counted
    from interp_engine.cli import main

    command = ["harvest", "interp:tiny", str(corpus), str(two), "--points", "resid_post.1", "--sae", f"res2={TINY_SAE}"]
    command += ["--top-k", "4", "--top-contexts", "3", "--context-size", "16", "--batch-rows", "2"]
    command += ["--shard-mb", repr(OPTIONS["shard_bytes"] / 2**20), "--quiet", "--backend", "eager"]
    assert main([*command, "--replicas", "2", "--ray-address", cluster]) == 0
    summary = json.loads(capsys.readouterr().out)
    shards = _shards(two)
    listed = {s["index"] for s in stopped["shards"]}
    new = [s for s in shards if s["index"] not in listed]
    assert all(s["replica"] == s["index"] % 2 for s in new)
    assert summary["replica_tokens"] == [sum(s["tokens"] for s in new if s["index"] % 2 == r) for r in (0, 1)]
    assert all(summary["replica_tokens"]) and sum(summary["replica_tokens"]) == summary["new_tokens"]
    _assert_same_harvest(one, two)
    assert not list(two.rglob("*.partial")) and sorted(p.name for p in (two / "top" / "res2").iterdir()) == [
        f"after_{len(shards):05d}.safetensors"
    ]


def test_a_replica_error_is_the_typed_error(tmp_path: pathlib.Path, corpus: pathlib.Path, cluster: str) -> None:
    """A model the replica cannot load is the error a one-process harvest raises (here
    ``ModelLoadError``), raised by the driver; nothing is written."""
    from interp_engine import ModelLoadError

    with pytest.raises(ModelLoadError, match="no such directory"):
        harvest(str(tmp_path / "none"), corpus, tmp_path / "x", replicas=1, addresses=["resid_post.0"], progress=False)
    assert not (tmp_path / "x").exists()


def test_replica_options_are_checked(tmp_path: pathlib.Path, direct: Any, corpus: pathlib.Path) -> None:
    with pytest.raises(InvalidOption, match="pass its name or folder"):
        harvest(direct, corpus, tmp_path / "x", replicas=2, addresses=["resid_post.0"], progress=False)
    with pytest.raises(InvalidOption, match="replicas is an int >= 1"):
        harvest("interp:tiny", corpus, tmp_path / "x", replicas=0, addresses=["resid_post.0"], progress=False)
    with pytest.raises(InvalidOption, match="go with replicas=N"):
        harvest(direct, corpus, tmp_path / "x", replica_resources={"num_gpus": 1}, addresses=["resid_post.0"])
    assert not (tmp_path / "x").exists()


def _failing_head(text: str, counter: pathlib.Path) -> Any:
    """A stand-in for ``ray start --head``: counts its starts in ``counter``, prints ``text`` and exits."""
    import sys

    script = f"import pathlib; p = pathlib.Path({str(counter)!r}); p.write_text(p.read_text() + 'x'); print({text!r})"
    return lambda port, folder, num_cpus, num_gpus: [sys.executable, "-c", script]


def test_the_test_clusters_head_starts_again_only_after_rays_startup_timeout(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The test kit's cluster starts its head again when Ray's raylet missed its fixed startup
    deadline (:data:`ray_cluster.STARTUP_TIMEOUT`), up to ``retries`` times, and fails at once on
    anything else, with the head's log."""
    from interp_testkit import ray_cluster

    counter = tmp_path / "starts"
    counter.write_text("")
    monkeypatch.setattr(ray_cluster, "head_command", _failing_head(ray_cluster.STARTUP_TIMEOUT, counter))
    with pytest.raises(RuntimeError, match=ray_cluster.STARTUP_TIMEOUT), ray_cluster.local_ray_cluster(retries=2):
        pass
    assert counter.read_text() == "xxx"
    counter.write_text("")
    monkeypatch.setattr(ray_cluster, "head_command", _failing_head("some other fault", counter))
    with pytest.raises(RuntimeError, match="some other fault"), ray_cluster.local_ray_cluster(retries=2):
        pass
    assert counter.read_text() == "x"
