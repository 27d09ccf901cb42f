"""The toy model: ``x = E[ids]``, then per layer ``x = x + tanh((x + causal_mean(x)) @ W_l)``,
``final_norm = x / |x|`` and ``logits = final_norm @ U``. Seeded, so every load is identical."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Iterator, Sequence
from typing import Any

import torch

from interp_engine import (
    Address,
    CheckedRequest,
    Completion,
    ModelBase,
    ModelInfo,
    Results,
    SteeringSpec,
    StreamStep,
    UnsupportedOperation,
    Write,
)
from interp_engine.backend import write_positions

SUPPORTED = ("embed", "resid_pre", "resid_post", "final_norm", "logits")
WRITABLE = ("embed", "resid_pre", "resid_post", "final_norm")
VOCAB = 128


class ToyModel(ModelBase):
    """A real (tiny) model implementing interp-engine's async protocol on the core's
    ``ModelBase``; it has no ``capture_batch`` and no end-of-sequence token, and decodes
    greedily (its only generation option is ``ignore_eos``)."""

    backend = "toy"
    supported_points = SUPPORTED
    writable_points = WRITABLE
    sampling_options = ("ignore_eos",)

    def __init__(self, name: str = "toy", *, seed: int = 0, n_layers: int = 3, d_model: int = 16) -> None:
        super().__init__(ModelInfo("ToyTanh", n_layers, d_model, d_model, 1, 1, VOCAB, n_ctx=64))
        self.name = name
        gen = torch.Generator().manual_seed(seed)
        self.embedding = torch.randn(VOCAB, d_model, generator=gen)
        self.weights = torch.randn(n_layers, d_model, d_model, generator=gen) / d_model**0.5
        self.unembed = torch.randn(d_model, VOCAB, generator=gen)

    def __repr__(self) -> str:
        return f"<ToyModel {self.name!r} {'closed' if self.closed else 'open'}>"

    # -- tokens ---------------------------------------------------------------------------
    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor:
        texts = [text] if isinstance(text, str) else list(text)
        rows = [[ord(c) % VOCAB for c in t] for t in texts]
        longest = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (longest - len(r)) for r in rows], dtype=torch.long)

    def to_string(self, tokens: Any) -> str | list[str]:
        ids = torch.as_tensor(tokens)
        if ids.dim() == 2:
            return [str(self.to_string(row)) for row in ids]
        return "".join(chr(int(t)) for t in ids.reshape(-1))

    def to_str_tokens(self, tokens: Any) -> list[str]:
        ids = self.to_tokens(tokens)[0] if isinstance(tokens, str) else torch.as_tensor(tokens).reshape(-1)
        return [chr(int(t)) for t in ids]

    def completion_text(self, tokens: Sequence[int]) -> str:
        return "".join(map(chr, tokens))

    # -- the forward pass -----------------------------------------------------------------
    def _forward(
        self, ids: list[int], points: Iterable[Address], writes: Sequence[Write] = (), n_prompt: int | None = None
    ) -> tuple[dict[Address, torch.Tensor], torch.Tensor]:
        """Activations at ``points`` and the logits, with ``writes`` applied where they point."""
        n_prompt = len(ids) if n_prompt is None else n_prompt
        wanted, acts = set(points), {}

        def tap(address: Address, x: torch.Tensor) -> torch.Tensor:
            for write in writes:
                if write.address == address:
                    x = _apply(write, x, n_prompt)
            if address in wanted:
                acts[address] = x.clone()
            return x

        x = tap(Address("embed"), self.embedding[torch.tensor(ids)])
        steps = torch.arange(1, len(ids) + 1).unsqueeze(1)
        for layer in range(self.info.n_layers):
            x = tap(Address("resid_pre", layer), x)
            x = x + torch.tanh((x + x.cumsum(0) / steps) @ self.weights[layer])
            x = tap(Address("resid_post", layer), x)
        x = tap(Address("final_norm"), x / x.norm(dim=-1, keepdim=True))
        logits = tap(Address("logits"), x @ self.unembed)
        return acts, logits

    def _generated(self, request: CheckedRequest) -> Iterator[tuple[int, torch.Tensor]]:
        """Each greedy token and the logits it was chosen from."""
        ids, n_prompt = list(request.token_ids), len(request.token_ids)
        for _ in range(request.max_tokens):
            self._check_open()
            _, logits = self._forward(ids, (), request.writes, n_prompt)
            token = int(logits[-1].argmax())
            ids.append(token)
            yield token, logits[-1]
            if self._stops(token, request.sampling):
                return

    # -- the async protocol ---------------------------------------------------------------
    async def warmup(self) -> None:
        self._check_open()

    async def capture(
        self, token_ids: Sequence[int], points: Iterable[Any], *, steering_spec: SteeringSpec | None = None
    ) -> dict[Address, torch.Tensor]:
        request = self._check_capture(token_ids, points, steering_spec)
        acts, _ = self._forward(request.token_ids, request.addresses, request.writes)
        return request.keyed(acts)

    async def _stream(self, request: CheckedRequest) -> AsyncGenerator[StreamStep, None]:
        if request.readouts or request.lens is not None:
            raise UnsupportedOperation("the toy backend streams tokens and their logprobs only (no readouts, no lens)")
        for token, logits in self._generated(request):
            top = torch.topk(torch.log_softmax(logits, dim=-1), request.n_logprobs)
            pairs = [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
            yield StreamStep(token, chr(token), pairs)

    async def generate(
        self, token_ids: Sequence[int], *, max_tokens: int, steering_spec: SteeringSpec | None = None, **sampling: Any
    ) -> Completion:
        request = self._check_generation(
            token_ids, [], max_tokens=max_tokens, steering_spec=steering_spec, sampling=sampling
        )
        return self._completion([token for token, _ in self._generated(request)], request.sampling)

    async def _capture_generation(self, request: CheckedRequest) -> tuple[Completion, Results]:
        if request.lens is not None:
            raise UnsupportedOperation("the toy backend reads no lens")
        tokens = [token for token, _ in self._generated(request)]
        n_prompt = len(request.token_ids)
        acts, _ = self._forward(request.token_ids + tokens, request.addresses, request.writes, n_prompt)
        return self._completion(tokens, request.sampling), request.keyed(acts)

    async def _decode_residuals(self, residuals: torch.Tensor) -> torch.Tensor:
        x = residuals.float()
        logits: torch.Tensor = (x / x.norm(dim=-1, keepdim=True)) @ self.unembed
        return logits


def _apply(write: Write, x: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """``x`` ``[n, width]`` with one write applied at the positions it selects (those present);
    the maths is the core's (``Write.apply``)."""
    x = x.clone()
    # named positions are ranges, so those of a shorter sequence are a prefix: rows line up
    for row, pos in enumerate(write_positions(write, n_prompt, x.shape[0])):
        if pos < x.shape[0]:
            vector = write.vector[row] if write.per_position else None
            target = write.target[row] if write.target is not None and write.target_per_position else None
            x[pos] = write.apply(x[pos], vector, target)
    return x
