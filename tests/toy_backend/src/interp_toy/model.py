"""The toy model: ``x = E[ids]``, then per layer ``x = x + tanh((x + causal_mean(x)) @ W_l)``,
``final_norm = x / |x|`` and ``logits = final_norm @ U``. Seeded, so every load is identical."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import torch

from interp_engine import (
    Address,
    Completion,
    InvalidActivations,
    ModelClosed,
    ModelInfo,
    SteeringSpec,
    StreamStep,
    Write,
)
from interp_engine.validation import (
    check_max_tokens,
    check_spec,
    check_token_ids,
    check_write_shapes,
    resolve_points,
    write_positions,
)

SUPPORTED = ("embed", "resid_pre", "resid_post", "final_norm", "logits")
WRITABLE = ("embed", "resid_pre", "resid_post", "final_norm")
VOCAB = 128


class ToyModel:
    """A real (tiny) model implementing interp-engine's async protocol; it has no ``capture_batch``."""

    backend = "toy"

    def __init__(self, name: str = "toy", *, seed: int = 0, n_layers: int = 3, d_model: int = 16) -> None:
        self.name = name
        self.info = ModelInfo("ToyTanh", n_layers, d_model, d_model, 1, 1, VOCAB, n_ctx=64)
        gen = torch.Generator().manual_seed(seed)
        self.embedding = torch.randn(VOCAB, d_model, generator=gen)
        self.weights = torch.randn(n_layers, d_model, d_model, generator=gen) / d_model**0.5
        self.unembed = torch.randn(d_model, VOCAB, generator=gen)
        self.closed = False

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

    # -- the forward pass -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ModelClosed(f"{self!r} was shut down; load a new model")

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

    # -- the async protocol ---------------------------------------------------------------
    async def warmup(self) -> None:
        self._check_open()

    async def capture(
        self, token_ids: Sequence[int], points: Iterable[Any], *, steering_spec: SteeringSpec | None = None
    ) -> dict[Address, torch.Tensor]:
        self._check_open()
        ids = check_token_ids(token_ids, self.info)
        addresses = resolve_points(points, self.info, SUPPORTED)
        writes = check_spec(steering_spec, self.info, WRITABLE)
        check_write_shapes(writes, len(ids), len(ids))
        acts, _ = self._forward(ids, addresses, writes)
        return {a: acts[a] for a in addresses}

    async def stream(
        self,
        token_ids: Sequence[int],
        *,
        max_tokens: int,
        n_logprobs: int = 0,
        steering_spec: SteeringSpec | None = None,
    ) -> AsyncIterator[StreamStep]:
        self._check_open()
        n = check_max_tokens(max_tokens)
        ids = check_token_ids(token_ids, self.info, extra=n)
        writes = check_spec(steering_spec, self.info, WRITABLE)
        check_write_shapes(writes, len(ids), len(ids) + n)
        n_prompt = len(ids)
        for _ in range(n):
            self._check_open()
            _, logits = self._forward(ids, (), writes, n_prompt)
            logprobs = torch.log_softmax(logits[-1], dim=-1)
            top = torch.topk(logprobs, n_logprobs) if n_logprobs else None
            token = int(logits[-1].argmax())
            ids.append(token)
            pairs = [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
            yield StreamStep(token, chr(token), pairs)

    async def generate(self, token_ids: Sequence[int], *, max_tokens: int) -> Completion:
        tokens = [step.token_id async for step in self.stream(token_ids, max_tokens=max_tokens)]
        return Completion(tokens, "".join(map(chr, tokens)), "length")

    async def capture_generation(
        self,
        token_ids: Sequence[int],
        points: Iterable[Any],
        *,
        max_tokens: int,
        steering_spec: SteeringSpec | None = None,
    ) -> tuple[Completion, dict[Address, torch.Tensor]]:
        self._check_open()
        points = resolve_points(points, self.info, SUPPORTED)  # before any compute
        steps = self.stream(token_ids, max_tokens=max_tokens, steering_spec=steering_spec)
        tokens = [step.token_id async for step in steps]
        ids = check_token_ids(token_ids, self.info) + tokens
        acts, _ = self._forward(ids, points, check_spec(steering_spec, self.info, WRITABLE), len(ids) - len(tokens))
        return Completion(tokens, "".join(map(chr, tokens)), "length"), {a: acts[a] for a in points}

    async def capture_attention(
        self, token_ids: Sequence[int], layers: Iterable[int], *, steering_spec: SteeringSpec | None = None
    ) -> dict[Address, torch.Tensor]:
        points = [Address("attn_pattern", layer) for layer in layers]
        return await self.capture(token_ids, points, steering_spec=steering_spec)

    async def decode_residuals(
        self, acts: torch.Tensor | Mapping[Address, torch.Tensor]
    ) -> torch.Tensor | dict[Address, torch.Tensor]:
        self._check_open()
        if isinstance(acts, Mapping):
            return {a: self._lens(t) for a, t in acts.items()}
        return self._lens(acts)

    def _lens(self, acts: Any) -> torch.Tensor:
        if not isinstance(acts, torch.Tensor) or acts.shape[-1:] != (self.info.d_model,):
            shape = list(acts.shape) if isinstance(acts, torch.Tensor) else type(acts).__name__
            raise InvalidActivations(f"decode_residuals takes [..., {self.info.d_model}] tensors, got {shape}")
        x = acts.float()
        logits: torch.Tensor = (x / x.norm(dim=-1, keepdim=True)) @ self.unembed
        return logits

    async def shutdown(self) -> None:
        self.closed = True


def _apply(write: Write, x: torch.Tensor, n_prompt: int) -> torch.Tensor:
    """``x`` ``[n, width]`` with one write applied at the positions it selects (those present);
    the maths is the core's (``Write.apply``)."""
    x = x.clone()
    # named positions are ranges, so those of a shorter sequence are a prefix: rows line up
    for row, pos in enumerate(write_positions(write, n_prompt, x.shape[0])):
        if pos < x.shape[0]:
            x[pos] = write.apply(x[pos], write.vector[row] if write.per_position else None)
    return x
