"""What quantising a model's routed experts costs, before any quantisation-aware training: the loss
of an HF-format K2 on chat records with its experts fake-quantised at several bit widths and
group sizes, against full precision.

    .venv/bin/python benchmarks/expert_quant_cost.py --model DIR --data sft.jsonl [--records 80]
        [--schemes 4:16,4:32,4:64,3:32,3:64,2:32,2:64]

DIR: an export (`k2 export RUN --out DIR`, e.g. of `make agentic-rl-demo`'s SFT run); data: chat
records `{messages, tools}` (its sft.jsonl). Loss: mean cross-entropy on the assistant tokens, as
`k2 sft` trains them. A scheme BITS:GROUP quantises every routed expert weight symmetrically per
group of GROUP inputs with bf16 scales; 4-bit is exactly `k2_model.int4.fake_quantize_int4` (the
weights an INT4 export loads), the other widths the same rule with 2^(BITS-1) - 1 as the top level.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_common import machine


def fake_quantize(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    if bits == 4:
        from k2_model.int4 import fake_quantize_int4

        return fake_quantize_int4(w, group)
    *lead, inp = w.shape
    x = w.to(torch.bfloat16).reshape(*lead, inp // group, group)
    top = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-1, keepdim=True) / torch.tensor(
        top + 0.5, dtype=torch.bfloat16
    )  # int4's rule: (7 - -8) / 2
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.clamp(torch.round(x / scale), -top - 1, top) * scale).reshape(w.shape).to(w.dtype)


@torch.no_grad()
def assistant_loss(model, tok, records: list[dict]) -> float:
    from k2_data.chat import render_ids_with_mask

    total, n = 0.0, 0
    for r in records:
        ids, mask = render_ids_with_mask(tok, r["messages"], r.get("tools"))
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        target, m = torch.tensor(ids[1:]), torch.tensor(mask[1:], dtype=torch.bool)
        total += float(-logp[torch.arange(len(target)), target][m].sum())
        n += int(m.sum())
    return total / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--records", type=int, default=80)
    ap.add_argument(
        "--schemes", default="4:16,4:32,4:64,3:32,3:64,2:32,2:64", help="BITS:GROUP, comma-separated"
    )
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from k2_data import load_tokenizer
    from k2_model import K2ForCausalLM
    from k2_model.moe import RoutedExperts

    torch.set_num_threads(args.threads)
    model = K2ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = load_tokenizer(args.model)
    with open(args.data) as f:
        records = [json.loads(line) for line, _ in zip(f, range(args.records))]
    experts = [p for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters()]
    full = [p.detach().clone() for p in experts]
    base = assistant_loss(model, tok, records)
    print(f"machine: {machine()}; model {args.model}; {len(records)} records of {args.data}\n")
    print("| routed experts | loss | vs full precision |\n|---|---|---|")
    print(f"| full precision | {base:.5f} | - |")
    for scheme in args.schemes.split(","):
        bits, group = (int(x) for x in scheme.split(":"))
        with torch.no_grad():
            for p, w in zip(experts, full):
                p.copy_(fake_quantize(w, bits, group))
        loss = assistant_loss(model, tok, records)
        print(f"| {bits}-bit, groups of {group} | {loss:.5f} | {loss - base:+.5f} |")
    with torch.no_grad():
        for p, w in zip(experts, full):
            p.copy_(w)


if __name__ == "__main__":
    main()
