"""The wire between interp-vllm's front end and vLLM's workers (``interp_vllm._wire``): every
channel's struct survives the trip as plain data, defaults live once, and the front end's client
calls exactly the RPCs the workers register.

No engine: the round trips go through ``to_wire``/``from_wire`` and a pickle, as
``collective_rpc`` carries them.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import msgspec
import pytest
import torch

from interp_engine import Address, FeatureReadout, Features
from interp_vllm import _wire as wire
from interp_vllm._wire import Fetched, FetchedWire, Ping, StaticDeclaration, WeightsHeld
from interp_vllm.frontend._client import Workers


def _trip(value: Any) -> Any:
    return pickle.loads(pickle.dumps(wire.to_wire(value)))


def test_a_ping_crosses_as_plain_data() -> None:
    ping = Ping("CPUModelRunner", True, static=True, rank=1, tp_size=2, lacks=("router_logits",), layers=(0, 1))
    data = _trip(ping)
    assert isinstance(data, dict) and data["rank"] == 1 and list(data["layers"]) == [0, 1]
    assert wire.from_wire(Ping, data) == ping
    assert wire.from_wire(Ping, {"runner": "X", "patched": False}).incompatible is None
    with pytest.raises(msgspec.ValidationError):
        wire.from_wire(Ping, {"runner": "X", "patched": "yes"})


def test_a_worker_without_taps_answers_its_ping_with_the_reason() -> None:
    """A model the worker cannot resolve still pings (vLLM's own requests keep being served): the
    answer says why it has no taps instead of raising."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from interp_vllm import _compat, _vllm_entry
    from interp_vllm.worker._manager import UntappedRunner

    class Runner(GPUModelRunner):  # a V2 runner (not built: that takes a whole engine)
        _interp_taps = UntappedRunner("its layers cannot be found")

    setattr(Runner, _compat.PATCHED, True)

    class Worker:
        model_runner = object.__new__(Runner)

    ping = wire.from_wire(Ping, _vllm_entry.interp_ping(Worker()))
    assert ping.patched and ping.unsupported == "its layers cannot be found" and ping.seam == "v2"
    # as a front end pings (telling its secret): the reason, not "this vLLM worker has no taps"
    told = wire.from_wire(Ping, _vllm_entry.interp_ping(Worker(), None, "front-end-secret"))
    assert told.unsupported == "its layers cannot be found"
    assert ping.lacks is None and ping.layers == () and (ping.pp_rank, ping.pp_size) == (0, 1)


def test_the_static_declaration_has_its_defaults_once() -> None:
    from interp_vllm.static import _model as _static_model

    declared = StaticDeclaration()
    assert declared.slots == wire.DEFAULT_SLOTS + 1
    assert declared.sae_top_k == wire.DEFAULT_SAE_TOP_K == _static_model.DEFAULT_SAE_TOP_K
    assert declared.sae_dense_max == wire.DEFAULT_SAE_DENSE_MAX == _static_model.DEFAULT_SAE_DENSE_MAX
    full = StaticDeclaration(
        points=("resid_post.1", "attn_pattern.0"),
        writes=("resid_pre.2",),
        slots=9,
        saes={"res": wire.SavedSae(path="/tmp/x", digest="ab")},
        sae_top_k=8,
    )
    data = _trip(full)
    assert data["saes"] == {"res": {"path": "/tmp/x", "digest": "ab"}} and data["sae_dense_max"] == 1024
    back = wire.from_wire(StaticDeclaration, data)
    assert back == full
    assert back.addresses() == ([Address("resid_post", 1), Address("attn_pattern", 0)], [Address("resid_pre", 2)])


def test_fetched_values_readouts_and_lens_cross_intact() -> None:
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(4)
    values = {Address("resid_post", 1): (positions, torch.randn(4, 8, generator=gen))}
    readout = FeatureReadout(torch.randn(4, 3, generator=gen), torch.randint(0, 100, (4, 3), dtype=torch.int16), None)
    readouts = {Features("res", 3): (positions, readout)}
    lens = (torch.tensor([2, 3]), torch.randint(0, 500, (2, 2, 5), dtype=torch.int16), torch.rand(2, 2, 5))
    sent = Fetched(values, None, readouts, lens)
    back = Fetched.decode(wire.from_wire(FetchedWire, _trip(sent.encode())))
    assert back.error is None
    got_positions, got_values = back.values[Address("resid_post", 1)]
    assert torch.equal(got_positions, positions) and torch.equal(got_values, values[Address("resid_post", 1)][1])
    got_readout = back.readouts[Features("res", 3)][1]
    assert torch.equal(got_readout.values, readout.values) and got_readout.ids is not None
    assert torch.equal(got_readout.ids.long(), readout.ids.long())
    assert back.lens is not None
    assert torch.equal(back.lens[0], lens[0]) and torch.equal(back.lens[1], lens[1].long())
    assert torch.equal(back.lens[2], lens[2])
    failed = Fetched.decode(wire.from_wire(FetchedWire, _trip(Fetched(error="boom").encode())))
    assert failed.error == "boom" and not failed.values and failed.lens is None


def test_weights_held_keeps_the_last_stages_fields() -> None:
    held = WeightsHeld(
        pp_rank=0,
        rank=0,
        dtype="float32",
        embed=True,
        o_bias=False,
        tied=True,
        norm=wire.FinalNorm(kind="rmsnorm", eps=1e-6, offset=0.0, weight=True, bias=False),
    )
    assert wire.from_wire(WeightsHeld, _trip(held)) == held
    with pytest.raises(msgspec.ValidationError):  # a norm kind the core does not know
        wire.from_wire(WeightsHeld, {**_trip(held), "norm": {**_trip(held)["norm"], "kind": "batchnorm"}})


class _Engine:
    """Records the RPC names called and answers each as one worker would."""

    def __init__(self) -> None:
        self.called: list[str] = []

    async def collective_rpc(self, name: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self.called.append(name)
        answers: dict[str, Any] = {
            wire.PING: lambda: wire.to_wire(Ping("CPUModelRunner", True)),
            wire.FETCH_MANY: lambda: [wire.to_wire(Fetched().encode()) for _ in args[0]],
            wire.DRAIN_MANY: lambda: [wire.to_wire(Fetched().encode()) for _ in args[0]],
            wire.DECODE: lambda: wire.pack_logits(wire.unpack_residuals(args[0]) * 2),
            wire.WEIGHT_INFO: lambda: wire.to_wire(
                WeightsHeld(pp_rank=0, rank=0, dtype="float32", embed=True, o_bias=True)
            ),
            wire.WEIGHT: lambda: wire.pack({"values": torch.ones(2)}),
            wire.STATS: lambda: {"live_requests": 0},
        }
        answer = answers.get(name)
        return [None if answer is None else answer()]


def test_the_client_calls_every_rpc_the_workers_register_and_decodes_the_answers() -> None:
    from interp_vllm._vllm_entry import WORKER_RPCS

    engine = _Engine()
    workers = Workers(engine)

    async def every() -> None:
        assert (await workers.ping())[0].runner == "CPUModelRunner"
        assert isinstance((await workers.fetch_many(["a", "b"]))[0][1], FetchedWire)
        assert len((await workers.drain_many(["a"]))[0]) == 1
        await workers.attach("res#0", b"")
        await workers.detach("res#0")
        await workers.release("a")
        logits = (await workers.decode(torch.ones(1, 4)))[0]
        assert logits is not None and torch.equal(logits, torch.full((1, 4), 2.0))
        assert (await workers.weight_info())[0].o_bias
        assert torch.equal((await workers.weight("b_O", 0, None))[0]["values"], torch.ones(2))
        assert (await workers.stats())[0] == {"live_requests": 0}

    asyncio.run(every())
    assert sorted(engine.called) == sorted(wire.RPC_NAMES) == sorted(WORKER_RPCS)
    assert len(set(wire.RPC_NAMES)) == len(wire.RPC_NAMES)
