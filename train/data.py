"""Training data: parquet loading with validation, masks from segments, collation and packing.

Every loss mask comes from segments (``trainable`` per run of tokens): prompt and observation
tokens never carry loss. Rows that only have chat messages (TRL datasets, the OpenManus import)
are encoded turn by turn with :func:`omrl_search.exports.segments_from_messages` — the engine's
own convention — so training matches search-time prompts.

Loading validates each row and fails on the first bad one with ``file:row: reason`` (rows
numbered from 1): missing columns, empty trajectories (no trainable token, also after cutting to
``max_length``), token ids outside the vocabulary, DPO pairs whose chosen and rejected sequences
do not share the prefix before their first trainable token, non-finite rewards.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .runtime import TrainError


class DataError(TrainError):
    """A bad data file or row (message: ``file:row: reason``)."""


@dataclass(slots=True)
class TokenRow:
    """One sequence: ids, the loss mask and behaviour logprobs aligned with the ids."""

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # 0.0 where unknown
    has_logprobs: bool  # every trainable token has a behaviour logprob
    reward: float = 0.0
    group: int = 0
    advantage: float = 0.0
    #: a reward model's value of the snapshot (None: the root) and after each turn (the grpo
    #: export's ``process`` column): what ``process_rewards`` turns into step advantages
    process: list[float | None] | None = None
    #: one advantage per assistant turn (dense process rewards, :func:`train.losses.process_advantages`);
    #: None: ``advantage`` on every trainable token
    step_advantages: list[float] | None = None
    #: ``(start, end, grammar record)``: ``input_ids[start:end]`` were sampled under that grammar
    #: (their behaviour logprobs are masked ones; :class:`GrammarMasks` rebuilds the masks)
    grammars: list[tuple[int, int, dict[str, Any]]] | None = None

    @property
    def prefix_len(self) -> int:
        """Tokens before the first trainable one."""
        return self.loss_mask.index(1) if 1 in self.loss_mask else len(self.loss_mask)


@dataclass(slots=True)
class PairRow:
    chosen: TokenRow
    rejected: TokenRow
    ref: tuple[float, float] | None = None  # reference sequence logps, once precomputed


# --- reading ------------------------------------------------------------------------------------
def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
        raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__})") from None


class RowBuilder:
    """Turns validated rows into :class:`TokenRow` s for one tokenizer and length limit."""

    def __init__(self, encoder: Any = None, vocab_size: int | None = None, max_length: int = 1024):
        self.encoder, self.vocab_size, self.max_length = encoder, vocab_size, max_length

    def from_segments(self, segs: Sequence[dict[str, Any]]) -> TokenRow:
        ids: list[int] = []
        mask: list[int] = []
        lps: list[float] = []
        spans: list[tuple[int, int, dict[str, Any]]] = []
        has = True
        for i, s in enumerate(segs):
            tok = s.get("token_ids")
            if not isinstance(tok, list) or not all(isinstance(t, int) for t in tok):
                raise ValueError(f"segment {i}: token_ids must be a list of ints")
            if self.vocab_size is not None and any(t < 0 or t >= self.vocab_size for t in tok):
                bad = next(t for t in tok if t < 0 or t >= self.vocab_size)
                raise ValueError(f"segment {i}: token id {bad} outside the vocabulary ({self.vocab_size})")
            train = bool(s.get("trainable"))
            lp = s.get("logprobs")
            if lp is not None and len(lp) != len(tok):
                raise ValueError(f"segment {i}: {len(lp)} logprobs for {len(tok)} tokens")
            if train and lp is None:
                has = False
            if train and lp is not None and s.get("grammar"):
                spans.append((len(ids), len(ids) + len(tok), dict(s["grammar"])))
            ids += tok
            mask += [int(train)] * len(tok)
            lps += [float(x) for x in lp] if lp is not None else [0.0] * len(tok)
        if len(ids) > self.max_length:
            ids, mask, lps = ids[:self.max_length], mask[:self.max_length], lps[:self.max_length]
        if not any(mask):
            raise ValueError("empty trajectory: no trainable tokens"
                             + (f" within max_length {self.max_length}" if len(ids) == self.max_length else ""))
        if mask[0]:
            raise ValueError("the first token is trainable (a sequence must start with a prompt)")
        spans = [(a, min(b, len(ids)), g) for a, b, g in spans if a < len(ids)]
        return TokenRow(ids, mask, lps, has, grammars=spans or None)

    def from_messages(self, messages: Any, train_from: int = 0) -> TokenRow:
        from omrl_search.exports import segments_from_messages

        if self.encoder is None:
            raise ValueError("no segments and no tokenizer to encode the messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("empty trajectory: no messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not m.get("role"):
                raise ValueError("messages must be {role, content} records")
        return self.from_segments(segments_from_messages(messages, self.encoder, train_from=train_from))

    def sequence(self, row: dict[str, Any], seg_col: str, msg_col: str | None) -> TokenRow:
        segs = row.get(seg_col)
        if segs:
            return self.from_segments(segs)
        if msg_col is None:
            raise ValueError(f"empty trajectory: no {seg_col}")
        return self.from_messages(row.get(msg_col))


#: the columns each trainer's rows need (each group: one of its names)
COLUMNS: dict[str, list[tuple[str, ...]]] = {
    "sft": [("segments", "messages")],
    "dpo": [("chosen_segments", "chosen"), ("rejected_segments", "rejected")],
    "grpo": [("segments",), ("value", "reward"), ("group_id",)],
}


def _check_columns(path: str | Path, cols: set[str], kind: str, exported: str | None = None) -> None:
    for group in COLUMNS[kind]:
        if not cols & set(group):
            names = " or ".join(repr(c) for c in group)
            what = f" (an `omrl export {exported}` file; {kind} trains on {kind} rows)" \
                if exported and exported != kind else ""
            raise DataError(f"{path}:1: missing column {names}{what}")


def check_files(paths: Sequence[str | Path], kind: str) -> None:
    """Before any model loads: each of ``paths`` is a parquet file with rows and the columns
    ``kind`` (:data:`COLUMNS`) needs. Only the files' footers are read; rows are validated
    when they are loaded. Errors: ``file[:row]: reason``."""
    import pyarrow.parquet as pq

    if not paths:
        raise DataError("no data files given (set data: [file.parquet, ...])")
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"{path}: no such file")
        try:
            f = pq.ParquetFile(path)
            schema, rows = f.schema_arrow, f.metadata.num_rows
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise DataError(f"{path}: not a readable parquet file ({type(exc).__name__})") from None
        if rows == 0:
            raise DataError(f"{path}: no rows")
        exported = (schema.metadata or {}).get(b"omrl.kind", b"").decode() or None
        _check_columns(path, set(schema.names), kind, exported)


def _load(paths: Sequence[str | Path], kind: str, convert: Callable[[dict[str, Any]], Any]) -> list[Any]:
    """Read every file, check ``kind``'s columns (:data:`COLUMNS`), convert each row; errors
    become ``file:row: reason``."""
    if not paths:
        raise DataError("no data files given (set data: [file.parquet, ...])")
    out = []
    for path in paths:
        rows = read_parquet(path)
        if not rows:
            raise DataError(f"{path}: no rows")
        _check_columns(path, set(rows[0]), kind)
        for i, row in enumerate(rows, 1):
            try:
                out.append(convert(row))
            except ValueError as exc:
                raise DataError(f"{path}:{i}: {exc}") from None
    return out


# --- per trainer ------------------------------------------------------------------------------------
def load_sft(paths: Sequence[str | Path], builder: RowBuilder) -> list[TokenRow]:
    """SFT rows: ``segments`` (exact ids) or ``messages`` (encoded turn by turn)."""
    return _load(paths, "sft", lambda row: builder.sequence(row, "segments", "messages"))


def load_dpo(paths: Sequence[str | Path], builder: RowBuilder) -> list[PairRow]:
    """DPO rows: ``chosen_segments``/``rejected_segments`` (whole sequences), or TRL's
    ``prompt``/``chosen``/``rejected`` messages (the prompt may be implicit: the shared leading
    turns of ``chosen`` and ``rejected``). The two sides must share the prefix before their first
    trainable token."""

    def convert(row: dict[str, Any]) -> PairRow:
        if row.get("chosen_segments") and row.get("rejected_segments"):
            c = builder.from_segments(row["chosen_segments"])
            r = builder.from_segments(row["rejected_segments"])
        else:
            chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
            if not chosen or not rejected:
                raise ValueError("empty trajectory: no chosen/rejected messages")
            if not prompt:
                n = 0
                while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
                    n += 1
                if n == 0:
                    raise ValueError("chosen and rejected share no prefix")
                prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
            c = builder.from_messages(list(prompt) + list(chosen), train_from=len(prompt))
            r = builder.from_messages(list(prompt) + list(rejected), train_from=len(prompt))
        p = c.prefix_len
        if p != r.prefix_len or c.input_ids[:p] != r.input_ids[:p]:
            raise ValueError("chosen and rejected do not share a prefix before the branch")
        if c.input_ids == r.input_ids:
            raise ValueError("chosen and rejected are identical")
        return PairRow(c, r)

    return _load(paths, "dpo", convert)


def load_grpo(paths: Sequence[str | Path], builder: RowBuilder) -> list[TokenRow]:
    """GRPO rows: ``segments`` (with behaviour logprobs when known), ``value`` (the training
    target: the row's Monte-Carlo value; omrl_search/exports.py), ``group_id``; group ids become
    dense integers. Files written before exports had ``value`` carry the target as ``reward``,
    which is read in its place."""
    groups: dict[Any, int] = {}

    def convert(row: dict[str, Any]) -> TokenRow:
        key = "value" if "value" in row else "reward"
        reward = row.get(key)
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"{key} must be a finite number, got {reward!r}")
        if row.get("group_id") is None:
            raise ValueError("group_id is missing")
        seq = builder.sequence(row, "segments", None)
        seq.reward = float(reward)
        seq.group = groups.setdefault(row["group_id"], len(groups))
        seq.process = row.get("process")
        return seq

    return _load(paths, "grpo", convert)


# --- constrained samples ------------------------------------------------------------------------
class GrammarMasks:
    """The token masks a grammar-constrained sampler applied, rebuilt for a batch.

    Under a grammar the sampler draws each token from, and records the logprob of, the masked
    distribution renormalised over the tokens the grammar allows
    (:mod:`omrl_search.constrain`). A trainer that recomputed plain ``log_softmax`` logprobs
    would start every PPO/GRPO update with an importance ratio below 1. For each span a row
    recorded (:attr:`TokenRow.grammars`), the grammar's matcher walks the span's tokens and
    gives the bitmask before each one; the forward pass (:func:`train.packing.model_logprobs`)
    sets the logits outside it to ``-inf`` before the log-softmax. The masker is built on first
    use (xgrammar) for the trainer's tokenizer, vocabulary and stop tokens, exactly as the
    ``hf`` backend builds its own, so both see the same masks."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], cache: int = 256):
        self.hf, self.vocab_size, self.stop_ids = hf_tokenizer, int(vocab_size), sorted(stop_ids)
        self._masker: Any = None
        # spans seen again (a round's rows cycled over its micro-batches, a group's shared
        # steps) are not walked again: (grammar, ids) -> (bitmasks, n), least recently used out
        self._cache: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
        self._cache_size = cache

    def _walk(self, record: dict[str, Any], ids: list[int]) -> tuple[Any, int]:
        from omrl_search.constrain import Grammar

        key = (tuple(sorted(record.items())), tuple(ids))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self.masker().masks_along(Grammar.from_record(record), ids)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return hit

    def masker(self) -> Any:
        if self._masker is None:
            from omrl_search.constrain import TokenMasker

            self._masker = TokenMasker.from_hf(self.hf, self.vocab_size, self.stop_ids)
        return self._masker

    def __call__(self, rows: Sequence[TokenRow]) -> dict[str, Any]:
        """``grammar_at`` (``[N, 2]``: batch row, position) and ``grammar_bits`` (``[N, W]``
        int32 bitmasks) for every constrained token of ``rows``, and the count of constrained
        tokens whose mask could not be rebuilt (the grammar refused them: they keep plain
        logprobs). Empty when no row was constrained."""
        import torch

        at: list[tuple[int, int]] = []
        bits: list[Any] = []
        missed = 0
        for b, row in enumerate(rows):
            for start, end, record in row.grammars or ():
                got, n = self._walk(record, row.input_ids[start:end])
                at += [(b, start + j) for j in range(n)]
                bits.append(got)
                missed += end - start - n
        if not at:
            return {}
        return {"grammar_at": torch.tensor(at, dtype=torch.long), "grammar_bits": torch.cat(bits),
                "stats": {"grammar_tokens": float(len(at)), "grammar_unmatched": float(missed)}}


# --- collation -----------------------------------------------------------------------------------
def collate(rows: Sequence[TokenRow], pad_id: int) -> dict[str, Any]:
    """Right-padded ``[B, T]`` tensors: ``input_ids``, ``attention_mask``, ``loss_mask``,
    ``old_logprobs``; ``[B]``: ``has_old``, ``rewards``, ``advantages``, ``groups``; ``n_tokens`` (not padding)."""
    import torch

    T = max(len(r.input_ids) for r in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    att = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    old = torch.zeros((B, T), dtype=torch.float32)
    for b, r in enumerate(rows):
        n = len(r.input_ids)
        ids[b, :n] = torch.tensor(r.input_ids)
        att[b, :n] = 1
        mask[b, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        old[b, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask, "old_logprobs": old,
            "n_tokens": att.sum(), "has_old": torch.tensor([r.has_logprobs for r in rows]),
            "rewards": torch.tensor([r.reward for r in rows], dtype=torch.float32),
            "advantages": advantages(rows, T),
            "groups": torch.tensor([r.group for r in rows], dtype=torch.long)}


def advantages(rows: Sequence[TokenRow], T: int) -> Any:
    """``[B]`` advantages, or ``[B, T]`` when a row has one per turn: its k-th run of trainable
    tokens gets its k-th step advantage (a turn cut off by the length limit takes its own)."""
    import torch

    if all(r.step_advantages is None for r in rows):
        return torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    out = torch.zeros((len(rows), T), dtype=torch.float32)
    for b, r in enumerate(rows):
        out[b, :len(r.input_ids)] = torch.tensor(token_advantages(r), dtype=torch.float32)
    return out


def token_advantages(row: TokenRow) -> list[float]:
    """Each token's advantage: ``step_advantages[k]`` on the k-th run of trainable tokens, 0
    elsewhere; ``advantage`` on every trainable token when the row has no step advantages."""
    if row.step_advantages is None:
        return [row.advantage * m for m in row.loss_mask]
    runs = sum(1 for t, m in enumerate(row.loss_mask) if m and (t == 0 or not row.loss_mask[t - 1]))
    if runs > len(row.step_advantages):
        raise ValueError(f"{runs} trainable turns but {len(row.step_advantages)} step advantages")
    out, k = [], -1
    for t, m in enumerate(row.loss_mask):
        if m and (t == 0 or not row.loss_mask[t - 1]):
            k += 1
        out.append(row.step_advantages[k] if m else 0.0)
    return out


def collate_pairs(pairs: Sequence[PairRow], pad_id: int) -> dict[str, Any]:
    """Chosen rows then rejected rows in one ``[2B, T]`` batch (one forward pass)."""
    return collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)


# --- packing -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class PackedRow:
    """Several sequences back to back; ``position_ids`` restart at 0 for each, and the trainers
    attend with a block-diagonal causal mask built from them (:func:`train.packing.block_mask`):
    no attention across sequences."""

    input_ids: list[int]
    loss_mask: list[int]
    position_ids: list[int]


def pack(rows: Sequence[TokenRow], max_length: int) -> list[PackedRow]:
    """First-fit-decreasing packing of sequences into rows of at most ``max_length`` tokens
    (deterministic: ties keep the input order)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].input_ids))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(rows[i].input_ids)
        j = next((k for k, left in enumerate(room) if left >= n), None)
        if j is None:
            bins.append([i])
            room.append(max_length - n)
        else:
            bins[j].append(i)
            room[j] -= n
    out = []
    for b in bins:
        ids, mask, pos = [], [], []
        for i in sorted(b):
            ids += rows[i].input_ids
            mask += rows[i].loss_mask
            pos += list(range(len(rows[i].input_ids)))
        out.append(PackedRow(ids, mask, pos))
    return out


def collate_packed(rows: Sequence[PackedRow], pad_id: int) -> dict[str, Any]:
    """``[B, T]`` packed batch with ``position_ids`` (the attention mask follows from them);
    padding is a separate run of positions with no loss."""
    import torch

    T = max(len(r.input_ids) for r in rows)
    B = len(rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    pos = torch.arange(T).repeat(B, 1)
    for b, r in enumerate(rows):
        n = len(r.input_ids)
        ids[b, :n] = torch.tensor(r.input_ids)
        mask[b, :n] = torch.tensor(r.loss_mask, dtype=torch.float32)
        pos[b, :n] = torch.tensor(r.position_ids)
        pos[b, n:] = torch.arange(T - n)
    return {"input_ids": ids, "loss_mask": mask, "position_ids": pos,
            "n_tokens": torch.tensor(sum(len(r.input_ids) for r in rows))}
