"""Teacher-forced proxy for the SFT tool-use proof, on a train state (no server, one forward per case).

A held-out call counts when every token of the assistant's tool-call turn is the argmax given the
right prefix, which is exactly what greedy decoding then emits. Used for the step-100/200 numbers in
the k2-train README ("A second attempt").

    python benchmarks/sft_tooluse_proxy.py RUN/state/step_000200 [heldout|train] [N]
"""

import collections
import json
import sys

import torch
from k2_data import chat
from k2_data.tokenizer import default_tokenizer_path, load_tokenizer
from k2_model import K2ForCausalLM
from k2_model.spec import ModelSpec
from k2_train.builders import load_init_weights, model_config
from k2_train.data import tooluse_example_dir

torch.set_num_threads(1)
run = sys.argv[1]
split = sys.argv[2] if len(sys.argv) > 2 else "heldout"
n = int(sys.argv[3]) if len(sys.argv) > 3 else 100
tok = load_tokenizer(default_tokenizer_path())
model = K2ForCausalLM(model_config(ModelSpec(init=run)))  # the architecture the run trained
print(load_init_weights(model, run))
model.eval()
recs = [json.loads(l) for l in open(tooluse_example_dir() / f"{split}.jsonl")][:n]
ok = collections.Counter()
tot = collections.Counter()
tok_ok = tok_tot = 0
for r in recs:
    if split == "heldout":
        ref = r["reference"]
        if ref is None:
            continue
        msgs = r["messages"] + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"functions.{ref['name']}:0",
                        "type": "function",
                        "function": {
                            "name": ref["name"],
                            "arguments": json.dumps(ref["arguments"], separators=(",", ":"))
                            if not isinstance(ref["arguments"], str)
                            else ref["arguments"],
                        },
                    }
                ],
            }
        ]
    else:
        msgs = r["messages"][:3]
        if not msgs[2].get("tool_calls"):
            continue
        ref = {"name": msgs[2]["tool_calls"][0]["function"]["name"]}
    ids, mask = chat.render_ids_with_mask(tok, msgs, r.get("tools"))
    x = torch.tensor([ids])
    with torch.no_grad():
        pred = model(x).logits[0].argmax(-1)
    pos = [t for t in range(len(ids) - 1) if mask[t + 1]]
    good = all(int(pred[t]) == ids[t + 1] for t in pos)
    tok_ok += sum(int(pred[t]) == ids[t + 1] for t in pos)
    tok_tot += len(pos)
    tot[ref["name"]] += 1
    ok[ref["name"]] += good
    if not good and tot[ref["name"]] <= 2:
        bad = [t for t in pos if int(pred[t]) != ids[t + 1]]
        print(
            "  miss",
            ref["name"],
            repr(tok.decode(ids[bad[0] - 3 : bad[0] + 2])),
            "->",
            repr(tok.decode([int(pred[bad[0]])])),
            "want",
            repr(tok.decode([ids[bad[0] + 1]])),
        )
print(
    split,
    {k: f"{ok[k]}/{tot[k]}" for k in tot},
    "all",
    f"{sum(ok.values())}/{sum(tot.values())}",
    f"token acc {tok_ok / tok_tot:.3f}",
)
