"""How a micro-batch meets the model: packed rows, and logits only where loss is taken.

Losses read the log-probabilities of the tokens that carry loss and nothing else, so the LM head
(a ``[hidden, vocab]`` matmul and a log-softmax over the whole vocabulary per position) runs only
at the positions that predict them: transformers' ``logits_to_keep`` selects those hidden states
before the head, and :func:`model_logprobs` returns ``[B, T]`` log-probabilities aligned with
the ids, filled on loss tokens and 0 elsewhere (what every loss reads; see :mod:`train.losses`).
A model without ``logits_to_keep`` gets full logits, then the same selection.

``layout`` (a policy trainer setting) chooses how the micro-batch's sequences are laid out:

* ``padded`` — one row per sequence, right-padded to the longest; plain causal attention, no
  mask (no real token attends to the padding after it; kernels with a faster causal path, e.g.
  flash attention on GPUs, take it);
* ``packed`` — sequences back to back in rows of about ``pack_tokens`` tokens, each with its own
  position ids (0, 1, ...) and a 4D boolean attention mask in which a token sees the earlier
  tokens of its own sequence only: no padding, no attention across sequences;
* ``shared-prefix`` — sequences that begin with the same tokens for at least half their length
  (a DPO pair's prompt, a GRPO group's) share a row and hold those tokens once: the row is a
  prefix tree in which a token sees its ancestors, so each sequence gets exactly the
  log-probabilities it has alone, while the shared prefix is run forward and backward once (its
  gradient is the sum of what each sequence sends it, as when run separately). Other sequences
  get rows of their own, padded as in ``padded``.

Measured with SmolLM2-135M on a 2-core CPU (``benchmarks/trainer_throughput.py`` data, batch 2,
fp32, CPU seconds of one forward + backward): SFT 13.8 s with full logits, 10.4 padded, 12.7
packed, 11.0 shared-prefix (rows share only the env's instructions); DPO 17.7, 14.8, 20.9, 8.6;
GRPO (two rows of a group) 12.2, 10.8, 11.2, 5.1. Concatenating sequences costs more attention
(a row of ``n1 + n2`` tokens attends over ``(n1 + n2)^2`` pairs) than padding wastes, so
``packed`` pays only when sequences are short and uneven; ``shared-prefix`` is the default.

In both packed layouts tokens after a sequence's last loss token are left out (nothing reads
them). Tokens sampled under a grammar (a batch with ``grammar_at`` / ``grammar_bits``, from
:class:`train.data.GrammarMasks`) get the log-softmax over the tokens the grammar allowed there,
the distribution they were sampled from, in every layout. A batch without layout keys (``data.collate`` alone) gets the plain path: full logits over
every position (kept as the reference the tests compare against).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .losses import sequence_logprobs

LAYOUTS = ("padded", "packed", "shared-prefix")
#: a sequence joins a shared-prefix row when at least this fraction of it is already there: below
#: it, the longer row's extra attention costs more than the shared tokens save
MIN_SHARED = 0.5


# --- layouts (built by the collate functions, on the CPU) ----------------------------------------
def add_layout(batch: dict[str, Any], layout: str, pack_tokens: int) -> dict[str, Any]:
    """Add the model inputs of ``layout`` to a collated batch (``input_ids``, ``attention_mask``,
    ``loss_mask`` ``[B, T]``): ``model_inputs`` (what the model is called with) and ``index``
    (``[B, T]``: where each token sits in the flattened model rows, -1 where it is left out).
    Rows that ``data.collate_packed`` already packed keep their layout, with a block mask."""
    ids = batch["input_ids"]
    B, T = ids.shape
    if "position_ids" in batch:  # rows already packed with several sequences (data.collate_packed)
        pos = batch["position_ids"]
        batch["model_inputs"] = {"input_ids": ids, "position_ids": pos, "attention_mask": block_mask(pos)}
        batch["index"] = torch.arange(B * T).view(B, T)
        return batch
    if layout == "padded":
        # right padding: no real token attends to the padding after it, so no mask is needed
        batch["model_inputs"] = {"input_ids": ids}
        batch["index"] = torch.arange(B * T).view(B, T)
        return batch
    att = batch["attention_mask"]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} (one of {', '.join(LAYOUTS)})")
    lengths = att.sum(-1).tolist()
    mask = batch["loss_mask"]
    seqs = []
    for b, n in enumerate(lengths):
        loss_at = mask[b, :n].nonzero()
        # inputs up to the last loss token (exclusive): its own hidden state predicts nothing read
        last = int(loss_at[-1]) if len(loss_at) else 1
        seqs.append(ids[b, :last].tolist())
    packed, index = pack_sequences(seqs, share=layout == "shared-prefix", max_tokens=pack_tokens)
    full = torch.full(ids.shape, -1, dtype=torch.long)
    for b, where in enumerate(index):
        full[b, :len(where)] = torch.tensor(where, dtype=torch.long)
    batch["model_inputs"] = packed
    batch["index"] = full
    return batch


def pack_sequences(seqs: Sequence[Sequence[int]], *, share: bool, max_tokens: int
                   ) -> tuple[dict[str, Tensor], list[list[int]]]:
    """Lay ``seqs`` out in rows of about ``max_tokens`` tokens (a longer sequence gets a row of
    its own). With ``share``, sequences are visited in token order so those with a common prefix
    meet, a row is a prefix tree (equal prefixes stored once), and a sequence joins the current
    row only if :data:`MIN_SHARED` of it is there already. Returns the model
    inputs (``input_ids``, ``position_ids`` ``[R, N]``, ``attention_mask`` ``[R, 1, N, N]``
    bool; only ``input_ids`` when every row holds one sequence: plain causal attention then) and,
    per sequence, the flattened index (``row * N + column``) of each of its tokens."""
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i])) if share else range(len(seqs))
    rows: list[dict[str, Any]] = []
    placed: dict[int, tuple[int, list[int]]] = {}
    for i in order:
        seq = seqs[i]
        row = rows[-1] if rows else None
        if row is not None:
            new = _new_tokens(row, seq, share)
            if len(row["ids"]) + new > max_tokens or (share and len(seq) - new < MIN_SHARED * len(seq)):
                row = None
        if row is None:
            row = {"ids": [], "pos": [], "children": {}, "paths": []}
            rows.append(row)
        cols = _insert(row, seq, share)
        row["paths"].append(cols)
        placed[i] = (len(rows) - 1, cols)
    N = max(len(r["ids"]) for r in rows) if rows else 1
    R = max(len(rows), 1)
    index = [[placed[i][0] * N + c for c in placed[i][1]] for i in range(len(seqs))]
    input_ids = torch.zeros(R, N, dtype=torch.long)
    position_ids = torch.zeros(R, N, dtype=torch.long)
    for r, row in enumerate(rows):
        n = len(row["ids"])
        input_ids[r, :n] = torch.tensor(row["ids"], dtype=torch.long)
        position_ids[r, :n] = torch.tensor(row["pos"], dtype=torch.long)
    if all(len(row["paths"]) == 1 for row in rows):  # one sequence a row: plain causal, as padded
        return {"input_ids": input_ids}, index
    attn = torch.eye(N, dtype=torch.bool).repeat(R, 1, 1)  # padding columns see themselves only
    for r, row in enumerate(rows):
        for cols in row["paths"]:  # a token sees its sequence's earlier tokens (its tree ancestors)
            c = torch.tensor(cols, dtype=torch.long)
            attn[r][c.unsqueeze(1), c.unsqueeze(0)] |= torch.ones(len(c), len(c), dtype=torch.bool).tril()
    return {"input_ids": input_ids, "position_ids": position_ids,
            "attention_mask": attn.unsqueeze(1)}, index


def _new_tokens(row: dict[str, Any], seq: Sequence[int], share: bool) -> int:
    """How many columns ``seq`` would add to ``row``."""
    if not share:
        return len(seq)
    node = -1
    for k, tok in enumerate(seq):
        node = row["children"].get((node, tok), None)
        if node is None:
            return len(seq) - k
    return 0


def _insert(row: dict[str, Any], seq: Sequence[int], share: bool) -> list[int]:
    cols, node = [], -1
    for depth, tok in enumerate(seq):
        child = row["children"].get((node, tok)) if share else None
        if child is None:
            child = len(row["ids"])
            row["ids"].append(int(tok))
            row["pos"].append(depth)
            if share:
                row["children"][(node, tok)] = child
        cols.append(child)
        node = child
    return cols


def block_mask(position_ids: Tensor) -> Tensor:
    """``[R, 1, N, N]`` causal mask of rows holding several sequences back to back, each starting
    at position 0 (``data.collate_packed``): a token sees the earlier tokens of its own run."""
    seq = (position_ids == 0).cumsum(-1)
    same = seq.unsqueeze(-1) == seq.unsqueeze(-2)
    N = position_ids.shape[-1]
    return (same & torch.ones(N, N, dtype=torch.bool).tril()).unsqueeze(1)


# --- the forward pass ---------------------------------------------------------------------------
def model_logprobs(model: Any, batch: dict[str, Any], *, hidden: bool = False
                   ) -> tuple[Tensor, Tensor | None]:
    """``([B, T]`` float32 log-probabilities of the batch's ids on its loss tokens, 0 elsewhere;
    with ``hidden``, ``[B, T, H]`` last hidden states that predicted each loss token, 0
    elsewhere)``. The LM head runs only where a loss token is predicted (see the module
    docstring); a batch without layout keys takes the plain full-logits path."""
    if "index" not in batch:
        return _full_path(model, batch, hidden)
    ids, mask = batch["input_ids"], batch["loss_mask"]
    B, T = ids.shape
    tb, tt = (mask[:, 1:] > 0).nonzero(as_tuple=True)
    tt = tt + 1  # loss token (tb, tt) is predicted by the hidden state of token (tb, tt - 1)
    src = batch["index"][tb, tt - 1]
    inputs = dict(batch["model_inputs"])
    R, N = inputs["input_ids"].shape
    keep = torch.zeros(R * N, dtype=torch.bool, device=ids.device)
    keep[src] = True
    compact = keep.cumsum(0) - 1  # kept position -> its row in the logits
    if "attention_mask" in inputs:
        inputs["attention_mask"] = _for_attention(inputs["attention_mask"])
    try:
        out = model(**inputs, use_cache=False, logits_to_keep=keep.view(R, N),
                    output_hidden_states=hidden)
    except TypeError as exc:  # a model whose forward has no logits_to_keep
        if "logits_to_keep" not in str(exc):
            raise
        out = model(**inputs, use_cache=False, output_hidden_states=hidden)
    logits = out.logits
    if logits.dim() == 3:  # [R, N, V]: every position (logits_to_keep unknown or ignored)
        logits = logits.reshape(R * N, -1)[keep]
    logits = logits.float()
    rows = compact[src]
    picked = logits[rows, ids[tb, tt]] - torch.logsumexp(logits, dim=-1)[rows]
    lp = torch.zeros(B, T, dtype=torch.float32, device=ids.device)
    lp[tb, tt] = picked
    if "grammar_at" in batch:
        gb, gt = batch["grammar_at"].unbind(-1)
        _masked_logprobs(lp, logits[compact[batch["index"][gb, gt - 1]]], ids, batch)
    h = None
    if hidden:
        last = out.hidden_states[-1]
        h = torch.zeros(B, T, last.shape[-1], dtype=last.dtype, device=ids.device)
        h[tb, tt] = last.reshape(R * N, -1)[src]
    return lp, h


def _masked_logprobs(lp: Tensor, logits: Tensor, ids: Tensor, batch: dict[str, Any]) -> None:
    """Overwrite ``lp`` at the constrained positions ``batch["grammar_at"]`` (whose predicting
    ``logits`` are given, one row each) with the log-softmax over the tokens the grammar allowed
    there (``batch["grammar_bits"]``, xgrammar's int32 bitmasks): the distribution the sampler
    drew from and recorded (:class:`train.data.GrammarMasks`)."""
    gb, gt = batch["grammar_at"].unbind(-1)
    allowed = unpack_bitmask(batch["grammar_bits"], logits.shape[-1])
    masked = logits.masked_fill(~allowed, float("-inf"))
    tok = ids[gb, gt]
    lp[gb, gt] = masked.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(masked, dim=-1)


def unpack_bitmask(bits: Tensor, vocab: int) -> Tensor:
    """``[N, W]`` int32 bitmasks (bit ``t % 32`` of word ``t // 32`` = token ``t`` allowed) as a
    ``[N, vocab]`` boolean tensor (tokens past the bitmask's width are not allowed)."""
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    flat = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if flat.shape[1] >= vocab:
        return flat[:, :vocab]
    return torch.nn.functional.pad(flat, (0, vocab - flat.shape[1]))


def _for_attention(mask: Tensor) -> Tensor:
    """A 4D boolean mask as an additive float mask (0 where attended, the float32 minimum
    elsewhere): eager attention adds it to its scores and sdpa takes it as it is (a float32 mask
    beside bf16 queries included), so no kernel needs to be told apart."""
    if mask.dim() != 4:
        return mask
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
        ~mask, torch.finfo(torch.float32).min)


def _full_path(model: Any, batch: dict[str, Any], hidden: bool) -> tuple[Tensor, Tensor | None]:
    """Full logits over every position (padded rows, or ``collate_packed`` rows with their
    position ids and a block mask)."""
    kw: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False}
    if "position_ids" in batch:
        kw["position_ids"] = batch["position_ids"]
        kw["attention_mask"] = _for_attention(block_mask(batch["position_ids"]))
    else:
        kw["attention_mask"] = batch["attention_mask"]
    out = model(**kw, output_hidden_states=hidden)
    lp = sequence_logprobs(out.logits, batch["input_ids"])
    if "grammar_at" in batch:
        gb, gt = batch["grammar_at"].unbind(-1)
        _masked_logprobs(lp, out.logits[gb, gt - 1].float(), batch["input_ids"], batch)
    if not hidden:
        return lp, None
    return lp, torch.nn.functional.pad(out.hidden_states[-1][:, :-1], (0, 0, 1, 0))
