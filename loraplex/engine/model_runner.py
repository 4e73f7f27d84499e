"""Turns a `SchedulerOutput` into tensors, runs the model and samples.

Letters: T tokens in the step, B requests that sample a token this step, R rows that score a prompt
token (`SamplingParams.prompt_logprobs`), C context length (tokens), nKV key/value heads, D head dim,
H hidden size, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loraplex.engine.attention import AttentionMetadata, PrefillChunk
from loraplex.engine.block_manager import BlockManager
from loraplex.engine.model import LlamaModel
from loraplex.engine.request import Request
from loraplex.engine.sampler import TokenLogprobs, prompt_token_logprobs, sample_rows
from loraplex.engine.scheduler import SchedulerOutput
from loraplex.kernels import build_lora_meta, huge_pages
from loraplex.model_config import ModelConfig


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block of `block_size` tokens across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.kv_size * itemsize


@dataclass
class StepResult:
    """What one step produced, by request id: the sampled token of each request whose tokens are now
    all computed, or the exception its sampling raised (that request alone is ended), and the
    log-probabilities of the tokens whose requests ask for them, and of the prompt tokens the step scored
    (in prompt order, continuing the request's `prompt_logprobs`)."""

    tokens: dict[str, int] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass
class ScoredRows:
    """A step's rows whose hidden states score prompt tokens: `rows` [R] (indices into the T rows), and per
    request in the step's order, (request, the position of its first such row, how many rows are its)."""

    rows: list[int] = field(default_factory=list)
    requests: list[tuple[Request, int, int]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and the paged KV cache: per layer (k, v), each [num_blocks * block_size, nKV, D]."""

    def __init__(self, model: LlamaModel, block_manager: BlockManager, dtype: torch.dtype, device: torch.device):
        cfg = model.cfg
        self.model = model
        self.cfg = cfg
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.device = device
        num_slots = block_manager.num_blocks * block_manager.block_size
        # one buffer for every layer's K and V: on a CPU on 2 MB pages (a decode step streams every
        # layer's K/V), which one mapping fills with no partly used page per tensor
        shape = (cfg.num_hidden_layers, 2, num_slots, cfg.num_key_value_heads, cfg.head_dim)
        caches = (huge_pages.zeros(shape, dtype) if device.type == "cpu"
                  else torch.zeros(shape, dtype=dtype, device=device))
        self.kv_caches = [(caches[i, 0], caches[i, 1]) for i in range(cfg.num_hidden_layers)]

    def _block_tables(self, block_tables: list[list[int]], length: int) -> torch.Tensor:
        """[N, ceil(length / block_size)] int64: the blocks holding positions 0..length-1, padded with 0."""
        width = -(-length // self.block_size)
        rows = [t[:width] + [0] * (width - len(t[:width])) for t in block_tables]
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def prepare(self, sched: SchedulerOutput, slot_ranks: list[int]):
        """Flatten the step: decodes (one new token) first, then prefill chunks.

        Returns (input_ids [T], positions [T], AttentionMetadata, LoRAMeta, sampled requests, their rows,
        `ScoredRows`).
        """
        reqs = sorted(sched.requests, key=lambda r: sched.num_scheduled_tokens[r.request_id] != 1)
        ids: list[int] = []
        positions: list[int] = []
        slot_ids: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        prefills: list[PrefillChunk] = []
        context_lens: list[int] = []
        scored = ScoredRows()
        num_decodes = 0
        for seq, req in enumerate(reqs):
            n = sched.num_scheduled_tokens[req.request_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            row = len(ids)
            ids += req.token_ids_between(start, end)
            positions += range(start, end)
            slot_ids += [req.virtual_slot] * n
            context_lens.append(end)
            if n == 1:
                num_decodes += 1
            else:
                prefills.append(PrefillChunk(row, n, seq, start))
            if end == req.num_tokens:
                sampled.append(req)
                sample_rows.append(len(ids) - 1)
            prompt_rows = req.prompt_logprob_rows(start, end)
            if prompt_rows:
                scored.rows += [row + p - start for p in prompt_rows]
                scored.requests.append((req, prompt_rows.start, len(prompt_rows)))
        slot_mapping = [self.block_manager.slot(req, p) for req in reqs
                        for p in range(req.num_computed_tokens,
                                       req.num_computed_tokens + sched.num_scheduled_tokens[req.request_id])]
        attn = AttentionMetadata(slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
                                 block_size=self.block_size, num_decode_tokens=num_decodes,
                                 block_tables=self._block_tables([r.block_table for r in reqs], max(context_lens)),
                                 context_lens=context_lens, prefills=prefills)
        lora = build_lora_meta(slot_ids, self.device, slot_ranks=slot_ranks) if any(
            s >= 0 for s in slot_ids) else None
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)
        return as_tensor(ids), as_tensor(positions), attn, lora, sampled, sample_rows, scored

    def execute(self, sched: SchedulerOutput, slot_ranks: list[int],
                before_sample: Callable[[Request], None] | None = None) -> StepResult:
        """Run one step and sample. An exception of the forward pass propagates (no request is to blame);
        one of a row's sampling is that row's entry in `StepResult.errors`, as is one of its prompt
        log-probabilities (non-finite logits)."""
        input_ids, positions, attn, lora, sampled, rows, scored = self.prepare(sched, slot_ranks)
        # the last layer's MLP on the sampled rows only (and those scoring prompt tokens), unless they are
        # all the rows (a decode-only step)
        rows = rows + scored.rows
        every = len(rows) == len(input_ids) and not scored.rows  # sampled rows are in step order: 0 .. T - 1
        out_rows = None if every else torch.tensor(rows, dtype=torch.int64, device=self.device)
        out_lora = None if every or lora is None else lora.select(rows)  # from host lists: no device sync
        hidden = self.model(input_ids, positions, self.kv_caches, attn, lora, out_rows, out_lora)  # [B + R, H]
        result = StepResult()
        if scored.rows:
            self._score_prompts(hidden[len(sampled):], scored, result)
            hidden = hidden[:len(sampled)]  # [B, H]
        tokens: list[int | None] = [None] * len(sampled)
        errors: list[Exception | None] = [None] * len(sampled)
        logprobs: list[TokenLogprobs | None] = [None] * len(sampled)
        rest = self._greedy(hidden, sampled, tokens, errors, before_sample)  # rows that need their logits
        if rest:
            logits = self.model.compute_logits(hidden if len(rest) == len(sampled) else hidden[rest])  # [B', V]
            for i, t, e, lp in zip(rest, *sample_rows(logits, [sampled[i] for i in rest], before_sample), strict=True):
                tokens[i], errors[i], logprobs[i] = t, e, lp
        for req, token, error, lp in zip(sampled, tokens, errors, logprobs, strict=True):
            if error is None:
                result.tokens[req.request_id] = token
                if lp is not None:
                    result.logprobs[req.request_id] = lp
            else:
                result.errors[req.request_id] = error
        return result

    def _score_prompts(self, hidden: torch.Tensor, scored: ScoredRows, result: StepResult) -> None:
        """Each scored row's prompt token log-probability into `result.prompt_logprobs` (a request whose
        logits are not finite gets its error in `result.errors` instead). hidden: [R, H] of `scored.rows`."""
        first = 0
        targets, ks = [], []
        for req, p0, n in scored.requests:  # position p scores prompt token p + 1
            targets += req.prompt_token_ids[p0 + 1:p0 + 1 + n]
            ks += [req.sampling_params.prompt_logprobs] * n
        lps, finite = prompt_token_logprobs(self.model.compute_logits, hidden, targets, ks)
        for req, _, n in scored.requests:
            if all(finite[first:first + n]):
                result.prompt_logprobs[req.request_id] = lps[first:first + n]
            else:
                result.errors[req.request_id] = ValueError(
                    "the model produced non-finite logits (NaN or Inf) at a prompt position; the request's adapter "
                    "may have weights too large for the model's dtype")
            first += n

    def _greedy(self, hidden: torch.Tensor, sampled: list[Request], tokens: list, errors: list,
                before_sample: Callable[[Request], None] | None) -> list[int]:
        """Fill tokens[i] (or errors[i], what before_sample raised) for the rows whose token is the plain
        argmax of their logits (greedy, no logprobs, no grammar), where `LlamaModel.greedy_tokens` finds it
        without the logits; returns the indices of the other rows, in order. hidden: [B, H]."""
        plain = [i for i, r in enumerate(sampled)
                 if r.sampling_params.is_greedy and r.sampling_params.logprobs is None and r.grammar is None]
        found = self.model.greedy_tokens(hidden if len(plain) == len(sampled) else hidden[plain]) if plain else None
        if found is None:
            return list(range(len(sampled)))
        done = set()
        for i, token in zip(plain, found, strict=True):
            if token < 0:
                continue  # a row the screen cannot bound (a NaN, say): its logits decide, in sample_rows
            done.add(i)
            try:
                if before_sample is not None:
                    before_sample(sampled[i])
                tokens[i] = token
            except Exception as exc:
                errors[i] = exc
        return [i for i in range(len(sampled)) if i not in done]
