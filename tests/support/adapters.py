"""Random LoRA adapters made with ``peft`` for the tests: the adapter folder, and the base model
with it merged into its weights (the oracle a run under the adapter must equal)."""

from __future__ import annotations

import pathlib
import shutil
from dataclasses import dataclass

import torch

TARGETS: dict[str, tuple[str, ...]] = {
    # attention and MLP projections of each family (GPT-2's are Conv1D: fan_in_fan_out)
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


@dataclass(frozen=True)
class Lora:
    adapter: pathlib.Path
    """The PEFT adapter folder."""
    merged: pathlib.Path
    """The base model with the adapter merged into its weights (``merge_and_unload``), tokenizer included."""


def make_lora(
    base: pathlib.Path,
    out: pathlib.Path,
    family: str,
    *,
    seed: int = 0,
    rank: int = 4,
    targets: tuple[str, ...] | None = None,
) -> Lora:
    """A LoRA of the model in ``base`` with random ``A`` and ``B`` (so it changes the model),
    saved in ``out/adapter``, and the merged model in ``out/merged``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=list(targets or TARGETS[family]),
        fan_in_fan_out=family == "gpt2",
        init_lora_weights=False,
    )
    tuned = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    with torch.no_grad():  # scaled so the adapter moves activations by a few percent, not swamps them
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    tuned.save_pretrained(out / "adapter")
    merged = tuned.merge_and_unload()
    merged.save_pretrained(out / "merged")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        if (base / name).is_file():
            shutil.copy(base / name, out / "merged" / name)
    return Lora(out / "adapter", out / "merged")
