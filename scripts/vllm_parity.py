"""The vllm backend's worst difference from HF ``transformers`` and from the eager backend, per
address kind, on each of vLLM's model runners: the figures behind the parity tests
(``tests/vllm/test_vllm_parity.py`` asserts each is within 1e-4).

    .venv/bin/python scripts/vllm_parity.py                 # both runners, the suite's four families
    .venv/bin/python scripts/vllm_parity.py --runners v2 --families llama

Each difference is ``interp_testkit.suite.rel_diff`` (the largest absolute difference over the
largest magnitude of the reference) over every layer of every family, on the suite's tiny
random-weight models (dev install: the test kit builds them). V2 on this CPU build runs through
the test kit's Triton-interpreter harness (``interp_testkit.runners``).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

KINDS = ("resid_pre", "resid_mid", "attn_out", "mlp_post", "mlp_out", "resid_post", "attn_pattern")


def main() -> None:
    import torch

    from interp_engine import Address, load_model, sync_model
    from interp_testkit import runners
    from interp_testkit.suite import KV_CACHE_BYTES, PROMPT, VLLM_ENGINE_ARGS, VLLM_FAMILIES, hf_for, rel_diff
    from interp_testkit.suite import vllm_model_path as path_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runners", default="v1,v2")
    parser.add_argument("--families", default=",".join(VLLM_FAMILIES))
    args = parser.parse_args()
    families = args.families.split(",")
    worst: dict[tuple[str, str, str], float] = defaultdict(float)  # (runner, kind, against)
    for runner in args.runners.split(","):
        for family in families:
            path = path_of(family)
            with runners.using(runner):
                model = sync_model(
                    load_model(
                        path, backend="vllm", kv_cache_memory_bytes=KV_CACHE_BYTES, **VLLM_ENGINE_ARGS.get(family, {})
                    )
                )
                model.warmup()
                runners.check_engine(model.model, runner)
            try:
                ids = model.to_tokens(PROMPT)[0].tolist()
                n = model.info.n_layers
                points = [Address("embed"), *(Address(k, layer) for layer in range(n) for k in KINDS)]
                points += [Address("final_norm"), Address("logits")]
                acts = model.capture(ids, points)
            finally:
                model.shutdown()
            with torch.no_grad():
                out = hf_for(path)(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
            hf = {Address("embed"): out.hidden_states[0][0], Address("logits"): out.logits[0]}
            hf[Address("final_norm")] = out.hidden_states[n][0]
            for layer in range(n):
                hf[Address("resid_pre", layer)] = out.hidden_states[layer][0]
                hf[Address("attn_pattern", layer)] = out.attentions[layer][0]
                if layer < n - 1:  # HF's last hidden state is after the final norm
                    hf[Address("resid_post", layer)] = out.hidden_states[layer + 1][0]
            eager = sync_model(load_model(path, backend="eager"))
            reference = eager.capture(ids, points)
            eager.shutdown()
            for point in points:
                kind = point.kind
                worst[(runner, kind, "eager")] = max(
                    worst[(runner, kind, "eager")], rel_diff(acts[point], reference[point])
                )
                if point in hf:
                    worst[(runner, kind, "HF")] = max(worst[(runner, kind, "HF")], rel_diff(acts[point], hf[point]))
    kinds = ["embed", *KINDS, "final_norm", "logits"]
    print(f"families: {', '.join(families)}")
    print(f"{'kind':14}" + "".join(f"{r + ' vs ' + a:>16}" for r in args.runners.split(",") for a in ("HF", "eager")))
    for kind in kinds:
        cells = []
        for runner in args.runners.split(","):
            for against in ("HF", "eager"):
                value = worst.get((runner, kind, against))
                cells.append(f"{value:>16.2e}" if value is not None else f"{'-':>16}")
        print(f"{kind:14}" + "".join(cells))


if __name__ == "__main__":
    main()
