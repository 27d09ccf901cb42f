"""The vllm backend on vLLM's Ray executor (``distributed_executor_backend="ray"``, its
multi-node path): tensor parallelism over Ray equals the eager backend on the same checkpoint
(and HF). The default executor's TP=2 is test_vllm_tp's subject: the reference here is not a
second vLLM engine.

The module starts a one-node Ray cluster on loopback (``ray start --head --block`` in a session
of its own, stopped when the module ends) and a TP=2 engine whose two workers are Ray actors of
that cluster, not children of this process. vLLM's CPU build takes no part in Ray placement
("current platform cpu does not support ray", vllm-project/vllm#21602), so the cluster declares
two logical GPUs and the test-only platform plugin :mod:`interp_testkit.ray_cpu` places the CPU
workers on them as vLLM's CUDA platform places its workers on GPUs; everything else is vLLM's
Ray executor unchanged. The workers load the ``vllm.general_plugins`` entry point of this
environment (the taps), and the front end's environment (``VLLM_USE_V2_MODEL_RUNNER=0``) reaches
them through the executor.

The Ray engine is this module's own (shut down when it ends). Needs ``ray`` (pinned in the
workspace's ``dev`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from interp_engine import Address, Features, SteeringSpec, Write
from interp_engine.sae._readouts import read_features
from interp_testkit import runners
from interp_testkit.ray_cluster import LOOPBACK_ENV, local_ray_cluster
from interp_testkit.suite import LONG, PROMPT, hf_for, rel_diff, vllm_model_path

from ..support import procs as _procs
from ..support.engines import started_engine
from ..support.readouts import assert_close_readout, assert_same_readout, eager_twin, make_sae

TOL = 1e-4
N_LAYERS, VOCAB = 3, 512
ENGINE = {"tensor_parallel_size": 2, "max_num_batched_tokens": 64}
CLUSTER_ENV = {
    "INTERP_TESTKIT_RAY_CPU": "1",  # the test-only platform: CPU workers on logical GPUs
    **LOOPBACK_ENV,  # every Ray process (and vLLM's, through VLLM_HOST_IP) on loopback, no auth token
}


def _start(**engine_args: Any) -> Any:
    return started_engine(vllm_model_path("llama"), **{**ENGINE, **engine_args})


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """A local Ray cluster for this module; the environment an engine joins it with."""
    with local_ray_cluster(num_gpus=4, env=CLUSTER_ENV) as address:
        yield {**CLUSTER_ENV, "RAY_ADDRESS": address, "VLLM_HOST_IP": "127.0.0.1"}


def _start_on_ray(cluster: dict[str, str], **engine_args: Any) -> Any:
    """An engine on the Ray executor: its engine core (a child of this process, started by
    warmup) joins the cluster with ``cluster``'s environment."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in cluster.items():
            env.setenv(name, value)
        return _start(distributed_executor_backend="ray", **engine_args)


@pytest.fixture(scope="module")
def engines(cluster: dict[str, str]) -> Iterator[tuple[Any, Any]]:
    """``(eager, ray)``: the eager backend on the llama checkpoint, and a TP=2 vllm engine on Ray."""
    before = _procs.children()
    ray = _start_on_ray(cluster)
    try:
        # the workers are the cluster's actors, not the engine core's children
        new = list(_procs.new_children(before).values())
        names = [p.name() for p in new]
        (core,) = [p for p in new if p.name() == "VLLM::EngineCore"]
        assert [p for p in core.children() if not _procs._is_multiprocessing_helper(p)] == [], names
        assert sum(n.startswith("ray::RayWorkerProc") for n in names) == 2, names
        yield eager_twin("llama"), ray
    finally:
        ray.shutdown()


def test_ray_workers_carry_the_taps(engines: tuple[Any, Any]) -> None:
    _, ray = engines
    assert ray.model.tp_size == 2
    assert ray.model.engine_kwargs["distributed_executor_backend"] == "ray"
    pings = ray.run(lambda: ray.model._engine.collective_rpc("interp_ping"))
    assert sorted(p["rank"] for p in pings) == [0, 1]
    assert all(p["patched"] and p["runner"] == "CPUModelRunner" for p in pings), pings
    # the front end's choice of model runner reached the Ray workers, and they run that runner
    chosen = os.environ[runners.RUNNER_VARIABLE]
    assert [p["v2_runner_env"] for p in pings] == [chosen, chosen]
    assert [p["seam"] for p in pings] == [runners.current()] * 2


@pytest.mark.parametrize("prompt", ["short", "long"])
def test_ray_tp2_captures_equal_eager(engines: tuple[Any, Any], prompt: str) -> None:
    eager, ray = engines
    ids = eager.to_tokens(PROMPT)[0].tolist() if prompt == "short" else LONG
    kinds = ("resid_pre", "resid_mid", "resid_post", "attn_q", "attn_k", "attn_v", "attn_z", "attn_scores")
    kinds += ("attn_pattern", "attn_out", "mlp_pre", "mlp_post", "mlp_out")
    points = [Address("embed"), *(Address(kind, layer) for layer in range(N_LAYERS) for kind in kinds)]
    points += [Address("final_norm"), Address("logits_raw"), Address("logits")]
    a, b = eager.capture(ids, points), ray.capture(ids, points)
    for point in points:
        assert b[point].shape == a[point].shape, point
        assert rel_diff(b[point], a[point]) <= TOL, point
    with torch.no_grad():
        out = hf_for(vllm_model_path("llama"))(torch.tensor([ids]), output_attentions=True)
    assert rel_diff(b[Address("logits")], out.logits[0]) <= TOL
    assert rel_diff(b[Address("attn_pattern", 2)], out.attentions[2][0]) <= TOL


def test_ray_tp2_steering_decode_and_generation(engines: tuple[Any, Any]) -> None:
    eager, ray = engines
    ids = eager.to_tokens(PROMPT)[0].tolist()
    n, d_head = len(ids), eager.info.d_head
    gen = torch.Generator().manual_seed(4)
    spec = SteeringSpec(
        [
            Write("resid_post.0", torch.randn(eager.info.d_model, generator=gen), op="add", scale=3.0),
            Write("mlp_post.1", torch.randn(eager.info.d_mlp, generator=gen), op="add", scale=2.0),  # per-rank slices
            Write("attn_z.2", torch.randn(2, 1, d_head, generator=gen), op="set", heads=[3], positions=[1, n - 1]),
        ]
    )
    points = ["resid_post.0", "mlp_post.1", "attn_z.2", "logits"]
    plain = eager.capture(ids, ["logits"])[Address("logits")]
    a = eager.capture(ids, points, steering_spec=spec)
    b = ray.capture(ids, points, steering_spec=spec)
    assert not torch.allclose(a[Address("logits")], plain, atol=1e-3)
    for point in a:
        assert rel_diff(b[point], a[point]) <= TOL, point
    residuals = torch.randn(2, 5, eager.info.d_model, generator=gen) * 3
    assert rel_diff(ray.decode_residuals(residuals), eager.decode_residuals(residuals)) <= TOL
    for prompt in (ids, LONG[:70]):
        c1 = eager.generate(prompt, max_tokens=8, ignore_eos=True)
        c2 = ray.generate(prompt, max_tokens=8, ignore_eos=True)
        assert c2.token_ids == c1.token_ids and c2.text == c1.text
    g1, a1 = eager.capture_generation(ids, ["resid_post.2", "mlp_post.0"], max_tokens=4, steering_spec=spec)
    g2, a2 = ray.capture_generation(ids, ["resid_post.2", "mlp_post.0"], max_tokens=4, steering_spec=spec)
    assert g2.token_ids == g1.token_ids
    for point in a1:
        assert rel_diff(a2[point], a1[point]) <= TOL, point
    s1 = list(eager.stream(ids, max_tokens=4, n_logprobs=3, ignore_eos=True))
    s2 = list(ray.stream(ids, max_tokens=4, n_logprobs=3, ignore_eos=True))
    assert [s.token_id for s in s2] == [s.token_id for s in s1]
    for x, y in zip(s1, s2, strict=True):
        assert [t for t, _ in y.logprobs] == [t for t, _ in x.logprobs]


def test_ray_tp2_sae_readouts(engines: tuple[Any, Any]) -> None:
    eager, ray = engines
    ids = eager.to_tokens(PROMPT)[0].tolist()
    sample = eager.capture(ids, ["resid_post.1"])[Address("resid_post", 1)]
    sae = make_sae("topk", "blocks.1.hook_resid_post", sample, seed=7)
    spec = Features("tray-res", 8)
    for facade in (eager, ray):
        facade.attach_sae("tray-res", sae)
    try:
        a = eager.capture(ids, [spec])
        b = ray.capture(ids, ["resid_post.1", spec])
        assert_same_readout(b[spec], read_features(sae, b[Address("resid_post", 1)], spec))
        assert_close_readout(b[spec], a[spec])
    finally:
        for facade in (eager, ray):
            facade.detach_sae("tray-res")
    assert [s["live_requests"] for s in ray.worker_stats()] == [0, 0]


@pytest.mark.apart  # a third Ray engine after the session's others: memory runs out here (docs/guides/scaling.md)
def test_ray_pp2_equals_eager(engines: tuple[Any, Any], cluster: dict[str, str]) -> None:
    """Pipeline stages over Ray (the multi-node layout: a stage per node) equal the eager
    backend: the front end finds each worker's stage from the workers themselves."""
    eager, _ = engines
    staged = _start_on_ray(cluster, tensor_parallel_size=1, pipeline_parallel_size=2)
    try:
        assert staged.model.pp_size == 2 and len(staged.model._stages) == 2
        ids = eager.to_tokens(PROMPT)[0].tolist()
        points = [Address("embed"), *(Address(k, layer) for layer in range(N_LAYERS) for k in ("resid_post", "attn_z"))]
        points += [Address("attn_pattern", N_LAYERS - 1), Address("final_norm"), Address("logits")]
        for prompt in (ids, LONG):
            a, b = eager.capture(prompt, points), staged.capture(prompt, points)
            for point in points:
                assert rel_diff(b[point], a[point]) <= TOL, point
        spec = SteeringSpec([Write("resid_post.0", torch.ones(eager.info.d_model), op="add", scale=2.0)])
        a, b = eager.capture(ids, ["logits"], steering_spec=spec), staged.capture(ids, ["logits"], steering_spec=spec)
        assert rel_diff(b[Address("logits")], a[Address("logits")]) <= TOL
        residuals = torch.randn(3, eager.info.d_model, generator=torch.Generator().manual_seed(1))
        assert rel_diff(staged.decode_residuals(residuals), eager.decode_residuals(residuals)) <= TOL
        assert (
            staged.generate(ids, max_tokens=6, ignore_eos=True).token_ids
            == eager.generate(ids, max_tokens=6, ignore_eos=True).token_ids
        )
    finally:
        staged.shutdown()
