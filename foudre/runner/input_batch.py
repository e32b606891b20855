"""The runner's persistent batch: what sampling needs of each running request, kept per slot.

A request enters with a ``NewRequest`` (admitted, resumed after a preemption, forked) and leaves
by id (finished, preempted); in between, a step reads its slot and writes nothing to it but the
tokens its row adds to the penalties' counts. Layout::

    slot:         0     1     2    ...            (slot_of: request id -> slot)
    temperature  [1.0, 0.7, 1.0, ...]  float32    (1 where greedy)
    greedy       [ T ,  F ,  T , ...]  bool
    top_k, top_p, min_p, uses_top              the warps (top_k <= 0 / top_p 1: off)
    penalty_row  [ -1,  0 , -1 , ...]  -> counts [P, vocab] float32, seen [P, vocab] bool
    and in Python lists: the generator (a seed), the grammar, logprobs wanted, token rules

A step gathers its sampling rows' parameters with one index per tensor (``sampling_batch``);
rare features (a seed, logprobs, allowed ids or a bias, ``min_tokens``, a grammar, penalties)
cost Python work only while some slot uses them. Each slot's block tables, computed-token count
and last sampled token live beside them, in ``tables`` (``slot_tables.py``): the rows' table
changes are written there (``apply_tables``) and the step's tables gathered from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from foudre.runner.slot_tables import SlotTables
from foudre.runner.step import NewRequest, ScheduledRow
from foudre.sample.rejection import DraftRows
from foudre.sample.sampler import (
    Penalties,
    SamplingBatch,
    banned_until_min_tokens,
    token_rules,
)
from foudre.sampling_params import SamplingParams
from foudre.structured.grammar import GrammarMatcher, fill_masks


@dataclass(slots=True)
class _Slot:
    """A slot's Python-side state (what no tensor holds)."""

    request_id: str
    params: SamplingParams
    eos_token_ids: frozenset[int]
    num_prompt: int
    generator: torch.Generator | None
    grammar: GrammarMatcher | None
    penalty_row: int = -1
    num_counted: int = 0  # leading tokens counted into the penalties' tables
    allowed: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class SamplingRows:
    """A step's sampling rows in batch order: per row the slot it samples for, the logits row
    it reads, its tokens so far (prompt and output, drafts excluded) and the drafts it
    verifies (forks: a child's own slot on its parent's last logits row, no drafts)."""

    request_ids: list[str] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)


class InputBatch:
    """Per-slot sampling state of the running requests (see the module docstring)."""

    def __init__(
        self, vocab_size: int, device: torch.device, capacity: int = 64, num_groups: int = 1
    ) -> None:
        """``num_groups``: the block tables each slot keeps (one per KV cache group)."""
        self.vocab_size = vocab_size
        self.tables = SlotTables(num_groups, 0)
        self.device = device
        self.slot_of: dict[str, int] = {}
        self._slots: list[_Slot | None] = []
        self._free: list[int] = []
        self.temperature = torch.ones(0, device=device)
        self.greedy = torch.ones(0, dtype=torch.bool, device=device)
        self.top_k = torch.zeros(0, dtype=torch.long, device=device)
        self.top_p = torch.ones(0, device=device)
        self.min_p = torch.zeros(0, device=device)
        self.uses_top = torch.zeros(0, dtype=torch.bool, device=device)
        self.repetition = torch.ones(0, device=device)
        self.presence = torch.zeros(0, device=device)
        self.frequency = torch.zeros(0, device=device)
        self._grow(capacity)
        # the penalties' tables, one row per penalised slot
        self.counts = torch.zeros(0, vocab_size, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_penalty_rows: list[int] = []
        # how many live slots use each rare feature (0: a step skips it)
        self.num_sampled = 0  # not greedy
        self.num_top = 0
        self.num_min_p = 0
        self.num_seeded = 0
        self.num_logprobs = 0
        self.num_grammar = 0
        self.num_rules = 0  # allowed ids, bias or min_tokens
        self.num_penalised = 0

    def __len__(self) -> int:
        return len(self.slot_of)

    def _grow(self, capacity: int) -> None:
        old = len(self._slots)
        if capacity <= old:
            return
        extra = capacity - old
        for name, fill in (
            ("temperature", 1.0),
            ("greedy", True),
            ("top_k", 0),
            ("top_p", 1.0),
            ("min_p", 0.0),
            ("uses_top", False),
            ("repetition", 1.0),
            ("presence", 0.0),
            ("frequency", 0.0),
        ):
            t = getattr(self, name)
            setattr(self, name, torch.cat([t, t.new_full((extra,), fill)]))
        self._slots += [None] * extra
        self._free += range(capacity - 1, old - 1, -1)
        self.tables.grow(capacity)

    # -- deltas --------------------------------------------------------------------------------
    def remove(self, request_ids: Sequence[str]) -> None:
        """Free the slots of these requests (ids not in the batch are ignored)."""
        for rid in request_ids:
            slot = self.slot_of.pop(rid, None)
            if slot is None:
                continue
            s = self._slots[slot]
            assert s is not None
            self._count_features(s, -1)
            if s.penalty_row >= 0:
                self._free_penalty_rows.append(s.penalty_row)
            self._slots[slot] = None
            self._free.append(slot)

    def add(self, requests: Sequence[NewRequest]) -> None:
        """Give each request a slot (replacing its old one, if it held one)."""
        for new in requests:
            self.remove([new.request_id])
            if not self._free:
                self._grow(2 * len(self._slots))
            slot = self._free.pop()
            p = new.sampling_params
            s = _Slot(
                new.request_id,
                p,
                new.eos_token_ids,
                len(new.prompt_token_ids),
                new.generator,
                new.grammar,
            )
            s.allowed, s.bias = token_rules(p, self.device)
            self._slots[slot] = s
            self.slot_of[new.request_id] = slot
            self.tables.reset(slot)
            self.temperature[slot] = p.temperature if p.temperature > 0 else 1.0
            self.greedy[slot] = p.greedy
            self.top_k[slot] = p.top_k
            self.top_p[slot] = p.top_p
            self.min_p[slot] = p.min_p
            self.uses_top[slot] = p.top_k > 0 or p.top_p < 1.0
            self.repetition[slot] = p.repetition_penalty
            self.presence[slot] = p.presence_penalty
            self.frequency[slot] = p.frequency_penalty
            if p.has_penalties:
                self._start_penalties(s, new)
            self._count_features(s, 1)

    def _count_features(self, s: _Slot, sign: int) -> None:
        p = s.params
        self.num_sampled += sign * (not p.greedy)
        self.num_top += sign * (p.top_k > 0 or p.top_p < 1.0)
        self.num_min_p += sign * (p.min_p > 0)
        self.num_seeded += sign * (s.generator is not None)
        self.num_logprobs += sign * (p.logprobs is not None)
        self.num_grammar += sign * (s.grammar is not None)
        rules = s.allowed is not None or s.bias is not None or p.min_tokens > 0
        self.num_rules += sign * rules
        self.num_penalised += sign * (s.penalty_row >= 0)

    def _start_penalties(self, s: _Slot, new: NewRequest) -> None:
        if not self._free_penalty_rows:
            old = self.counts.shape[0]
            size = max(2 * old, 8)
            self.counts = torch.cat(
                [self.counts, self.counts.new_zeros(size - old, self.vocab_size)]
            )
            self.seen = torch.cat([self.seen, self.seen.new_zeros(size - old, self.vocab_size)])
            self._free_penalty_rows += range(size - 1, old - 1, -1)
        row = s.penalty_row = self._free_penalty_rows.pop()
        self.counts[row].zero_()
        self.seen[row].zero_()
        tokens = new.prompt_token_ids + new.output_token_ids
        if tokens:
            self.seen[row, torch.tensor(tokens, device=self.device)] = True
        if new.output_token_ids:
            out = torch.tensor(new.output_token_ids, device=self.device)
            self.counts[row].index_put_((out,), torch.ones(len(out), device=self.device), True)
        s.num_counted = len(tokens)

    # -- a step --------------------------------------------------------------------------------
    def apply_tables(self, rows: Sequence[ScheduledRow]) -> list[int]:
        """Each row's slot, in order; writes the rows' table changes into their slots."""
        slot_of = self.slot_of
        tables = self.tables
        slots: list[int] = []
        for r in rows:
            slot = slot_of.get(r.request_id)
            if slot is None:
                raise KeyError(f"request {r.request_id!r} is not in the runner's batch")
            slots.append(slot)
            if r.block_ids:
                tables.apply(slot, 0, r.table_start, r.block_ids)
            if r.group_block_ids:
                starts = r.group_table_starts or [0] * len(r.group_block_ids)
                for g, (start, ids) in enumerate(zip(starts, r.group_block_ids, strict=True)):
                    tables.apply(slot, g + 1, start, ids)
        return slots

    def sampling_rows(self, rows: Sequence[ScheduledRow]) -> SamplingRows:
        """The step's sampling rows (see ``SamplingRows``); counts the rows' new tokens into the
        penalties of penalised slots."""
        out = SamplingRows()
        slot_of = self.slot_of
        counting = self.num_penalised > 0
        new_tokens: list[tuple[int, int, bool]] = []  # (penalty row, token, in the output)
        next_row = 0
        for r in rows:
            n_spec = len(r.spec_token_ids)
            end = r.start + len(r.token_ids) - n_spec
            if counting:
                self._new_tokens(r, end, new_tokens)
            if not r.num_logits:
                continue
            assert r.num_logits == n_spec + 1, "drafts cut"
            slot = slot_of.get(r.request_id)
            assert slot is not None, f"request {r.request_id!r} is not in the runner's batch"
            out.request_ids.append(r.request_id)
            out.slots.append(slot)
            out.logit_rows.append(next_row)
            out.num_tokens.append(end)
            out.drafts.append(r.spec_token_ids)
            out.draft_probs.append(r.spec_probs)
            last = next_row + n_spec
            next_row += r.num_logits
            for fork_id in r.fork_ids:
                out.request_ids.append(fork_id)
                out.slots.append(slot_of[fork_id])
                out.logit_rows.append(last)
                out.num_tokens.append(end)
                out.drafts.append([])
                out.draft_probs.append(None)
        if new_tokens:
            self._count(new_tokens)
        return out

    def _new_tokens(self, r: ScheduledRow, end: int, into: list[tuple[int, int, bool]]) -> None:
        slot = self.slot_of.get(r.request_id)
        s = self._slots[slot] if slot is not None else None
        if s is None or s.penalty_row < 0 or end <= s.num_counted:
            return
        assert r.start <= s.num_counted, "tokens the penalties never saw"
        for pos in range(max(r.start, s.num_counted), end):
            into.append((s.penalty_row, r.token_ids[pos - r.start], pos >= s.num_prompt))
        s.num_counted = end

    def accept_drafts(self, rows: SamplingRows, num_accepted: Sequence[int]) -> None:
        """Count the accepted drafts of a verification into the penalties of penalised slots:
        they are output now, and no later row computes them again."""
        if not self.num_penalised:
            return
        new_tokens: list[tuple[int, int, bool]] = []
        for slot, end, drafts, n in zip(
            rows.slots, rows.num_tokens, rows.drafts, num_accepted, strict=True
        ):
            s = self._slot(slot)
            if n and s.penalty_row >= 0 and s.num_counted == end:
                new_tokens += [
                    (s.penalty_row, t, end + j >= s.num_prompt) for j, t in enumerate(drafts[:n])
                ]
                s.num_counted = end + n
        if new_tokens:
            self._count(new_tokens)

    def _count(self, new_tokens: list[tuple[int, int, bool]]) -> None:
        rows = torch.tensor([t[0] for t in new_tokens], device=self.device)
        toks = torch.tensor([t[1] for t in new_tokens], device=self.device)
        self.seen[rows, toks] = True
        out = torch.tensor([t[2] for t in new_tokens], device=self.device)
        if bool(out.any()):
            ones = out.to(self.counts.dtype)
            self.counts.index_put_((rows, toks), ones, accumulate=True)

    def sampling_batch(self, rows: SamplingRows) -> SamplingBatch:
        """The parameters of ``rows``' logits, one batch row per logits position: a row that
        verifies ``k`` drafts takes ``k + 1`` (draft position ``j`` as if its first ``j``
        drafts were output)."""
        pos = _Positions.of(rows)
        idx = torch.tensor(pos.slots, device=self.device)
        greedy = self.greedy[idx]
        batch = SamplingBatch(
            greedy, self.num_sampled == 0 or bool(greedy.all()), self.temperature[idx]
        )
        if self.num_top and bool(self.uses_top[idx].any()):
            batch.top_k, batch.top_p = self.top_k[idx], self.top_p[idx]
        if self.num_min_p:
            batch.min_p = self.min_p[idx]
        states = [self._slot(s) for s in pos.slots] if self._rare() else []
        if self.num_seeded:
            batch.generators = _unless_none([s.generator for s in states])
        if self.num_logprobs:
            batch.logprobs = _unless_none([s.params.logprobs for s in states])
        if self.num_rules:
            self._rules(batch, states, rows, pos)
        if self.num_penalised:
            batch.penalties = self._penalties(idx, states, rows, pos)
        if self.num_grammar:
            masks = [
                (self._slot(s).grammar, d) for s, d in zip(rows.slots, rows.drafts, strict=True)
            ]
            batch.grammars = fill_masks(masks, self.vocab_size)
        return batch

    def _rare(self) -> bool:
        return bool(self.num_seeded or self.num_logprobs or self.num_rules or self.num_penalised)

    def draft_rows(self, rows: SamplingRows) -> DraftRows:
        """What verification reads per request, besides the batch's parameters."""
        states = [self._slot(s) for s in rows.slots]
        return DraftRows(
            rows.drafts,
            rows.draft_probs,
            [s.generator for s in states],
            [s.params.greedy for s in states],
            [s.params.logprobs for s in states],
        )

    def _slot(self, slot: int) -> _Slot:
        s = self._slots[slot]
        assert s is not None
        return s

    def _rules(
        self, batch: SamplingBatch, states: list[_Slot], rows: SamplingRows, pos: _Positions
    ) -> None:
        for b, s in enumerate(states):
            if s.allowed is not None:
                batch.allowed.append((b, s.allowed))
            if s.bias is not None:
                batch.bias.append((b, *s.bias))
            if s.params.min_tokens:
                num_output = rows.num_tokens[pos.row(b)] - s.num_prompt + pos.before(b)
                banned = banned_until_min_tokens(s.params, s.eos_token_ids, num_output)
                if banned:
                    batch.banned.append((b, banned))

    def _penalties(
        self, idx: torch.Tensor, states: list[_Slot], rows: SamplingRows, pos: _Positions
    ) -> Penalties | None:
        """The penalties of the batch rows whose request has some: its counts, and at a draft
        position the drafts before it counted as output."""
        batch_rows = [b for b, s in enumerate(states) if s.penalty_row >= 0]
        if not batch_rows:
            return None
        table = torch.tensor([states[b].penalty_row for b in batch_rows], device=self.device)
        counts, seen = self.counts[table], self.seen[table]
        drafted = [(k, rows.drafts[pos.row(b)][: pos.before(b)]) for k, b in enumerate(batch_rows)]
        pairs = [(k, t) for k, drafts in drafted for t in drafts]
        if pairs:
            at = torch.tensor([k for k, _ in pairs], device=self.device)
            toks = torch.tensor([t for _, t in pairs], device=self.device)
            counts.index_put_((at, toks), torch.ones(len(pairs), device=self.device), True)
            seen[at, toks] = True
        b_t = torch.tensor(batch_rows, device=self.device)
        sel = idx[b_t]
        return Penalties(
            b_t, self.repetition[sel], self.presence[sel], self.frequency[sel], counts, seen
        )


def _unless_none(values: list) -> list | None:  # type: ignore[type-arg]
    return values if any(v is not None for v in values) else None


@dataclass(slots=True)
class _Positions:
    """A step's logits positions: per position its slot; with drafts, per position its sampling
    row and how many of that row's drafts come before it (None without drafts: position ``b``
    is sampling row ``b``, after no draft)."""

    slots: list[int]
    rows: list[int] | None = None
    drafts_before: list[int] | None = None

    @classmethod
    def of(cls, rows: SamplingRows) -> _Positions:
        if not rows.has_drafts:
            return cls(rows.slots)
        slots: list[int] = []
        index: list[int] = []
        before: list[int] = []
        for i, (slot, drafts) in enumerate(zip(rows.slots, rows.drafts, strict=True)):
            for j in range(len(drafts) + 1):
                slots.append(slot)
                index.append(i)
                before.append(j)
        return cls(slots, index, before)

    def row(self, b: int) -> int:
        return b if self.rows is None else self.rows[b]

    def before(self, b: int) -> int:
        return 0 if self.drafts_before is None else self.drafts_before[b]
