"""One forward per prompt for its K responses: the RL batch packed as prompt + K responses per row.

An RL batch holds K responses to each prompt, and the prompt is often half of every row (a system
prompt plus a question, then a short answer). Row by row, the trainer runs the prompt's tokens K
times through every layer. Packed, each group is one row, `prompt | response_1 | ... | response_K`,
with an explicit attention matrix: a response's tokens see the whole prompt and their own earlier
tokens, never another response, and their positions continue from the prompt's end as if the
response followed it alone. The prompt's hidden states are then the same for all K, so the forward
computes them once; the prompt's last position predicts every response's first token.

Same numbers, less work: the per-token log-probs come back in the row layout ([B, S], as
`k2_rl.loss.token_logprobs` returns them) and equal the row-by-row forward's within float
rounding, gradients included (`tests/test_shared_prompt.py`). The cost moves from the token count
to a dense [S, S] mask on the masked attention path, so packing is used only while a packed row
stays short (`MAX_PACKED_LEN`); longer rows keep the row layout and its fused attention.
"""

from __future__ import annotations

import torch
from k2_train.losses import IGNORE_INDEX
from torch import Tensor, nn

# Longest packed row (prompt + K responses) that is packed: the [S, S] mask per group and the
# masked attention's S^2 work stay small next to what sharing saves (measured on CPU: 16 prompts x
# 8 responses of ~45 + ~42 tokens, rows of ~380, 1.3x faster forward + backward than row by row).
MAX_PACKED_LEN = 1024


class Packing:
    """Where each row of the row-layout batch lives in the packed batch."""

    def __init__(self, batch: dict[str, Tensor], pad_id: int) -> None:
        ids, labels = batch["input_ids"], batch["shift_labels"]
        prompt_lens, group_ids = batch["prompt_lens"].tolist(), batch["group_ids"].tolist()
        resp_lens = (labels != IGNORE_INDEX).sum(1).tolist()
        order: dict[int, list[int]] = {}
        for r, g in enumerate(group_ids):
            order.setdefault(g, []).append(r)
        self.groups = list(order.values())
        lengths = [prompt_lens[rs[0]] + sum(resp_lens[r] for r in rs) for rs in self.groups]
        S = max(lengths)
        G = len(self.groups)
        dev = ids.device
        self.input_ids = torch.full((G, S), pad_id, dtype=torch.long, device=dev)
        self.position_ids = torch.zeros((G, S), dtype=torch.long, device=dev)
        allowed = torch.zeros((G, S, S), dtype=torch.bool, device=dev)
        self.logits_mask = torch.zeros((G, S), dtype=torch.bool, device=dev)
        # (row, its label positions in the row layout) -> packed (group, position) predicting each
        src_g, src_pos, dst_row, dst_pos = [], [], [], []
        for g, rs in enumerate(self.groups):
            P = prompt_lens[rs[0]]
            self.input_ids[g, :P] = ids[rs[0], :P]
            self.position_ids[g, :P] = torch.arange(P, device=dev)
            allowed[g, :P, :P] = True
            self.logits_mask[g, P - 1] = True
            at = P
            for r in rs:
                n = resp_lens[r]
                if n == 0:  # nothing of this row is scored
                    continue
                self.input_ids[g, at : at + n] = ids[r, P : P + n]
                self.position_ids[g, at : at + n] = torch.arange(P, P + n, device=dev)
                allowed[g, at : at + n, :P] = True
                allowed[g, at : at + n, at : at + n] = True
                self.logits_mask[g, at : at + n - 1] = True
                # label t of the response (row position P - 1 + t) is predicted by the prompt's last
                # position for t = 0 and by the response's own token t - 1 after that
                src_g += [g] * n
                src_pos += [P - 1] + list(range(at, at + n - 1))
                dst_row += [r] * n
                dst_pos += list(range(P - 1, P - 1 + n))
                at += n
        self.attention_mask = allowed & torch.ones(S, S, dtype=torch.bool, device=dev).tril()
        # index of each needed position among the logits_mask positions (row-major order)
        k_of = torch.full((G, S), -1, dtype=torch.long, device=dev)
        k_of[self.logits_mask] = torch.arange(int(self.logits_mask.sum()), device=dev)
        self.k_index = k_of[torch.tensor(src_g, device=dev), torch.tensor(src_pos, device=dev)]
        self.dst = (torch.tensor(dst_row, device=dev), torch.tensor(dst_pos, device=dev))
        self.labels = labels[self.dst]
        self.packed_len = S
        # the rollout engine's routing (k2_rl.routing), moved with the tokens
        self.routed_experts = None
        if "routed_experts" in batch:
            rec = batch["routed_experts"]
            self.routed_experts = rec.new_full((G, S, *rec.shape[2:]), -1)
            for g, rs in enumerate(self.groups):
                P = prompt_lens[rs[0]]
                self.routed_experts[g, :P] = rec[rs[0], :P]
                at = P
                for r in rs:
                    n = resp_lens[r]
                    self.routed_experts[g, at : at + n] = rec[r, P : P + n]
                    at += n


def packable(batch: dict[str, Tensor]) -> bool:
    """Whether the batch can be packed: it names its prompts (`prompt_lens`, `group_ids`), each
    row's labels are exactly its response (the positions right after the prompt), and the rows of
    a group share their prompt tokens."""
    if "prompt_lens" not in batch or "group_ids" not in batch:
        return False
    ids, labels = batch["input_ids"], batch["shift_labels"]
    plens, groups = batch["prompt_lens"], batch["group_ids"]
    n = (labels != IGNORE_INDEX).sum(1)
    pos = torch.arange(labels.shape[1], device=labels.device).unsqueeze(0)
    start = (plens - 1).unsqueeze(1)
    expected = (pos >= start) & (pos < start + n.unsqueeze(1))
    if not bool(((labels != IGNORE_INDEX) == expected).all()) or bool((plens < 1).any()):
        return False
    first: dict[int, int] = {}
    for r, g in enumerate(groups.tolist()):
        f = first.setdefault(g, r)
        P = int(plens[r])
        if int(plens[f]) != P or not torch.equal(ids[r, :P], ids[f, :P]):
            return False
    longest = max(
        int(plens[rows[0]]) + int(n[rows].sum())
        for rows in (torch.nonzero(groups == g).flatten() for g in first)
    )
    return longest <= MAX_PACKED_LEN


def shared_prompt_token_logprobs(model: nn.Module, batch: dict[str, Tensor], pad_id: int) -> Tensor:
    """`token_logprobs` of a packable batch with one prompt pass per group: [B, S] in the row
    layout, 0 outside the responses."""
    pk = Packing(batch, pad_id)
    routes = {} if pk.routed_experts is None else {"routed_experts": pk.routed_experts}
    logits_KN = model(
        input_ids=pk.input_ids,
        position_ids=pk.position_ids,
        attention_mask=pk.attention_mask,
        logits_mask=pk.logits_mask,
        **routes,
    ).logits.float()
    logp_KN = torch.log_softmax(logits_KN, dim=-1)
    values = logp_KN[pk.k_index, pk.labels]
    out = torch.zeros(batch["shift_labels"].shape, dtype=values.dtype, device=values.device)
    return out.index_put(pk.dst, values)


__all__ = ["MAX_PACKED_LEN", "Packing", "packable", "shared_prompt_token_logprobs"]
