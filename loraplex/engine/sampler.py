"""Per-row sampling: greedy, temperature, top-k, top-p, with seeds that hold in any batch.

Letters: B rows (requests that produce a token this step), V vocab.

A row's randomness comes from a generator seeded by (request seed, output index), never from a
shared stream, so a request with a seed yields the same tokens whatever else is in the batch and after
preemption and recompute. Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) draws
token i with probability p_i (the Gumbel-max trick in another form).

A row with a grammar (`SamplingParams.json_schema`) is drawn from its logits with the tokens its grammar
disallows set to -inf, in place (`structured_output.apply_grammar_masks_`, after the finite-logits check);
other rows are not touched.

Log-probabilities (`token_logprobs`, for rows whose params ask for them) are log_softmax of the row's
logits in fp32, after the grammar mask and before temperature, top-k and top-p: vLLM's default
`logprobs_mode="raw_logprobs"`, and what OpenAI's `logprobs` report. Tokens a grammar excludes
(log-probability -inf) are left out of a row's top list, which may then be shorter than asked.

Rows that want only the argmax (greedy, no logprobs, no grammar) may not come here: where the lm_head's
bf16 screen runs (`kernels/cpu_greedy.py`), `ModelRunner` takes their tokens from it, the same tokens
`sample` gives, without the logits.

`sample_rows` isolates rows: when the batched call raises, each row is sampled alone, so a request
whose sampling fails ends alone and every other row gets the token it would have got.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.engine.request import Request
from loraplex.engine.structured_output import apply_grammar_masks_
from loraplex.kernels import cpu_ext

_MASK = 2**63 - 1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One output token's log-probability (natural log, fp32) and the `SamplingParams.logprobs` most likely
    tokens' as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int | None]
                   ) -> list[TokenLogprobs | None]:
    """logits: [B, V], tokens: each row's sampled token -> each row's `TokenLogprobs`, None for rows that
    did not ask (or have no token)."""
    out: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None and tokens[i] is not None]
    if rows:
        scored = _scored(logits[rows].float(), [tokens[i] for i in rows],
                         [requests[i].sampling_params.logprobs for i in rows])
        for i, lp in zip(rows, scored, strict=True):
            out[i] = lp
    return out


def _scored(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """logits [B', V] fp32 -> each row's `TokenLogprobs` of tokens[b] with its ks[b] most likely tokens'
    (log_softmax; alternatives at -inf, a grammar's masked tokens, are left out)."""
    lp = torch.log_softmax(logits, dim=-1)  # [B', V]
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(ks, default=0)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [B', K]
    return [TokenLogprobs(token, value, tuple((t, p) for t, p in zip(ids[:n], values[:n], strict=True)
                                              if p != float("-inf")))
            for token, value, ids, values, n in zip(tokens, chosen, top_ids.tolist(), top_lp.tolist(), ks,
                                                    strict=True)]


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """logits [B, V] -> whether each row holds no NaN or Inf. A NaN or Inf makes its row's sum non-finite:
    one cheap pass (0.6 ms against isfinite's 12.7 ms on [64, 49152] fp32, one thread); only then the
    exact test, which also clears a finite row whose sum overflowed."""
    ok = torch.isfinite(logits.sum(dim=-1))
    return (ok if ok.all() else torch.isfinite(logits).all(dim=-1)).tolist()


PROMPT_LOGITS_ROWS = 128  # prompt rows whose logits exist at once: [128, V] fp32 is 25 MB at V = 49152


def prompt_token_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                          targets: list[int], ks: list[int]) -> tuple[list[TokenLogprobs], list[bool]]:
    """Score prompt tokens: hidden [R, H] (row r the final hidden state of the position before token
    targets[r]), compute_logits [r, H] -> fp32 [r, V] (`LlamaModel.compute_logits`) -> each row's
    `TokenLogprobs` of targets[r] with its ks[r] most likely tokens (natural log, the raw logits' log-softmax,
    as the output tokens' `token_logprobs`), and whether the row's logits were all finite (a row that was
    not gets NaN values). The logits are made PROMPT_LOGITS_ROWS rows at a time, so a long prompt's
    [R, V] never exists whole."""
    out: list[TokenLogprobs] = []
    finite: list[bool] = []
    for i in range(0, len(targets), PROMPT_LOGITS_ROWS):
        logits = compute_logits(hidden[i:i + PROMPT_LOGITS_ROWS])  # [r, V]
        finite += finite_rows(logits)
        out += _scored(logits, targets[i:i + PROMPT_LOGITS_ROWS], ks[i:i + PROMPT_LOGITS_ROWS])
    return out, finite


def _row_seed(seed: int, index: int) -> int:
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & _MASK


def sample(logits: torch.Tensor, requests: list[Request], checked: bool = False) -> list[int]:
    """logits: [B, V] fp32, row i for requests[i] -> one token id per row. Rows with a grammar are masked in
    place first (the caller's logprobs then see the masked logits). checked: `logits` passed
    `check_finite` before any mask was applied (a -inf in a row with a grammar may be its mask's).

    Raises ValueError when a row's logits are not all finite (NaN or Inf, e.g. from an adapter with
    overflowing weights): no token can be drawn from them, and the request must not get an arbitrary one;
    and when a row's grammar fails (`apply_grammar_masks_`).
    """
    if not checked:
        check_finite(logits, len(requests))
    apply_grammar_masks_(logits, requests)
    tokens = first_max(logits)
    rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
    if not rows:
        return tokens
    params = [requests[i].sampling_params for i in rows]
    x = logits[rows]  # [B', V]
    temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
    x = x / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        x = _top_k_top_p(x, params)
    probs = torch.softmax(x, dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(rows):
        req = requests[i]
        gen = torch.Generator(device=x.device).manual_seed(_row_seed(req.seed, req.num_output_tokens))
        noise[j].exponential_(generator=gen)
    picked = (probs / noise).argmax(dim=-1).tolist()
    for j, i in enumerate(rows):
        tokens[i] = picked[j]
    return tokens


def first_max(logits: torch.Tensor) -> list[int]:
    """logits [B, V] -> each row's first maximal index: `logits.max(dim=-1).indices`, argmax's pick. fp32
    CPU rows go to the CPU kernels' one pass
    (`csrc/first_max_cpu.cpp`: 0.2-0.4 ms against PyTorch's 3-5 ms on [64, 49152], one Zen 4 core;
    docs/performance.md), the same picks; other dtypes and devices, a machine without the kernels and a
    batch with a row the kernel leaves (a NaN, which `check_finite` keeps from getting here) take
    PyTorch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and 0 < logits.shape[1] < 2**31 and logits.stride(-1) == 1 and not logits.is_neg():
        ext = cpu_ext.load()
        if ext is not None:
            tokens = ext.first_max(logits).tolist()
            if min(tokens, default=0) >= 0:
                return tokens
    return logits.max(dim=-1).indices.tolist()


def check_finite(logits: torch.Tensor, num_rows: int) -> None:
    """Raise ValueError if any row of logits [B, V] holds a NaN or an Inf (`finite_rows`)."""
    bad = finite_rows(logits).count(False)
    if bad:
        raise ValueError(f"the model produced non-finite logits (NaN or Inf) in {bad} of {num_rows} "
                         "row(s); the request's adapter may have weights too large for the model's dtype")


def sample_rows(logits: torch.Tensor, requests: list[Request], before: Callable[[Request], None] | None = None
                ) -> tuple[list[int | None], list[Exception | None], list[TokenLogprobs | None]]:
    """`sample` and `token_logprobs`, one row's failure ending that row alone. logits: [B, V] fp32, masked in
    place for the rows with a grammar.

    Returns (tokens, errors, logprobs): row i has a token, no error and its logprobs (None unless asked),
    or None, the exception its sampling raised and None. `before(request)`, if given, runs before each row
    is sampled (`LLMEngine.inject_fault`); what it raises counts as that row's failure.
    """
    checked = False
    try:
        for req in requests if before is not None else ():
            before(req)
        check_finite(logits, len(requests))
        checked = True  # from here on, rows with a grammar may be masked in place
        tokens = sample(logits, requests, checked=True)
        return tokens, [None] * len(requests), token_logprobs(logits, requests, tokens)
    except Exception:  # find the rows that fail; greedy and seeded rows give the same tokens alone
        pass
    tokens: list[int | None] = []
    errors: list[Exception | None] = []
    logprobs: list[TokenLogprobs | None] = []
    for i, req in enumerate(requests):
        try:
            if before is not None:
                before(req)
            row = logits[i:i + 1]  # a view: its mask lands in `logits`
            token = sample(row, [req], checked=checked and req.grammar is not None)[0]
            logprobs.append(token_logprobs(row, [req], [token])[0])
            tokens.append(token)
            errors.append(None)
        except Exception as exc:
            tokens.append(None)
            errors.append(exc)
            logprobs.append(None)
    return tokens, errors, logprobs


def _top_k_top_p(x: torch.Tensor, params) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus. x: [B', V]."""
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)  # [B', V]
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=x.device)
    drop = rank >= k[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=x.device)
    probs = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p: the most likely token always stays.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(-1, order, sorted_x)
