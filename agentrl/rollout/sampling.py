"""Drawing the next token of every running row from its logits, and the drawn token's logprob.

The transformers engine samples itself (hf_engine.py says why it runs its own decode loop), so this
is the one place its sampling settings (temperature, top-p) take effect.
"""

from __future__ import annotations

from typing import Sequence

import torch


def request_generator(seed: int | None) -> torch.Generator | None:
    """The random stream of a request with a seed (SamplingParams.seed), on the CPU: a draw per
    token is a few microseconds there, and it makes the stream the same on every device."""
    return None if seed is None else torch.Generator().manual_seed(seed)


def uniform_draws(n: int, generator: torch.Generator | None, row_generators: Sequence[torch.Generator | None],
                  device: torch.device) -> torch.Tensor:
    """One uniform number per row, [n, 1]: from the row's own stream where it has one, so a seeded
    request samples the same tokens whatever else shares its batch; the other rows draw from the
    shared `generator`, in row order."""
    if not any(g is not None for g in row_generators):
        return torch.rand((n, 1), generator=generator, dtype=torch.float64, device=device)
    own = [None if g is None else torch.rand(1, generator=g, dtype=torch.float64).item() for g in row_generators]
    shared = iter(torch.rand(own.count(None), generator=generator, dtype=torch.float64, device=device).tolist())
    return torch.tensor([[next(shared) if x is None else x] for x in own], dtype=torch.float64, device=device)


def sample_tokens(logits_BV: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
                  row_generators: Sequence[torch.Generator | None] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids and their logprobs under softmax(logits / temperature), before top-p.

    Temperature 0 is greedy, with logprobs of the unscaled distribution. The logprob reported is
    of the distribution the trainer recomputes, so top-p truncation is not reflected in it.
    Sampling inverts each row's cumulative distribution at one uniform draw (`uniform_draws`: from
    `row_generators[i]` where given, else `generator`): `torch.multinomial`
    draws an exponential variate per vocabulary entry, 31 ms of a 160 ms decode step for 32 rows
    of SmolLM2's 49k-token vocabulary, against about 2 ms for a cumulative sum and a search.
    """
    logits_BV = logits_BV.float()
    if temperature <= 0:
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        ids_B = logp_BV.argmax(dim=-1)
    else:
        # Each row's largest logit taken out first (log_softmax does it anyway): a tiny temperature
        # then sends the others to -inf instead of the largest to +inf, which made every logprob NaN.
        logp_BV = torch.log_softmax((logits_BV - logits_BV.amax(dim=-1, keepdim=True)) / temperature, dim=-1)
        probs_BV, order_BV = logp_BV.exp(), None
        if top_p < 1.0:
            probs_BV, order_BV = nucleus(probs_BV, top_p)
        cdf_BV = probs_BV.cumsum(dim=-1, dtype=torch.float64)
        draw_B1 = uniform_draws(len(cdf_BV), generator, row_generators, cdf_BV.device)
        # The first entry whose cumulative probability exceeds the draw: never one of probability 0.
        ids_B = torch.searchsorted(cdf_BV, draw_B1 * cdf_BV[:, -1:], right=True).squeeze(1)
        ids_B = ids_B.clamp(max=cdf_BV.shape[1] - 1)  # a draw that rounds onto the total
        if order_BV is not None:
            ids_B = order_BV.gather(1, ids_B[:, None]).squeeze(1)
    return ids_B, logp_BV.gather(1, ids_B[:, None]).squeeze(1)


NUCLEUS_CANDIDATES = 256


def nucleus(probs_BV: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities in descending order, zero past its top-p nucleus (a token stays
    while the mass before it is at most `top_p`, so the top token always stays), and their ids.

    Only the `NUCLEUS_CANDIDATES` most likely tokens are ordered when they hold more than `top_p`
    of every row's mass, which they almost always do: sorting a whole 49k vocabulary took 57 ms
    for 32 rows on 2 cores, about half a decode step, against 3 ms for the top 256. A flatter row
    sorts everything, with the same result. Which way a row goes is its own: topk and sort order
    tied probabilities (common in bf16) differently, so one flat row sorting its whole batch
    changed which token a seeded row drew, against SamplingParams.seed's promise."""
    B, V = probs_BV.shape
    k = min(NUCLEUS_CANDIDATES, V)
    top_BK, order_BK = probs_BV.topk(k, dim=-1)
    flat_B = ~(top_BK.sum(dim=-1) > top_p) if k < V else torch.zeros(B, dtype=torch.bool, device=probs_BV.device)
    if bool(flat_B.any()):
        # the other rows widened with zeros (past their nucleus anyway), the flat ones fully sorted
        top_BK = torch.cat([top_BK, top_BK.new_zeros(B, V - k)], dim=-1)
        order_BK = torch.cat([order_BK, order_BK[:, -1:].expand(B, V - k)], dim=-1)
        top_BK[flat_B], order_BK[flat_B] = probs_BV[flat_B].sort(dim=-1, descending=True)
    cumulative_BK = top_BK.cumsum(dim=-1)
    return top_BK.masked_fill(cumulative_BK - top_BK > top_p, 0.0), order_BK
