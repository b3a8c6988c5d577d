"""Greedy or sampled: the one rule for a draft token and its draft probabilities.

A temperature below :data:`~vllm_dlite.config.GREEDY_EPS` (vLLM's ``_SAMPLING_EPS``) drafts
greedily (argmax); any other temperature ``T`` draws from ``softmax(fp32 logits / T)``, and that
distribution is the row's draft probabilities, which vLLM's rejection sampler needs to stay
lossless. A greedy row's probabilities are ``softmax(logits)`` (``T = 1``): vLLM does not read them
for greedy requests (as in its ``compute_probs_and_sample_next_token``).

A draft round samples only where the engine asks for it (vLLM's ``draft_sample_method:
"probabilistic"``) and some request is sampled (:func:`draft_temperatures`); otherwise every
request drafts greedily.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_dlite.config import GREEDY_EPS


def is_greedy(temperature: float) -> bool:
    """Whether a row with this temperature drafts greedily."""
    return temperature < GREEDY_EPS


def greedy_rows_as(temperatures: torch.Tensor, value: float) -> torch.Tensor:
    """Per-row temperatures as fp32, greedy rows replaced by ``value`` (0: "greedy" for the
    drafter, which groups rows by temperature; 1: the temperature of their probabilities)."""
    t = temperatures.float()
    return torch.where(t < GREEDY_EPS, torch.full_like(t, value), t)


def draft_temperatures(sampled: bool, temperatures: Optional[torch.Tensor], all_greedy: bool = False,
                       rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The per-request temperatures a draft round samples with (fp32), or None: greedy drafts.

    None when the engine does not sample drafts (``sampled`` False: vLLM's ``draft_sample_method``
    is not ``"probabilistic"``, or nothing is sampled in this call), has no temperatures, or every
    request is greedy (``all_greedy``, where the caller knows it without a host sync). ``rows``
    picks the batch's requests out of ``temperatures``. In a sampled round, greedy rows still draft
    greedily (:func:`greedy_rows_as`)."""
    if not sampled or temperatures is None or all_greedy:
        return None
    return (temperatures if rows is None else temperatures[rows]).float()


def next_tokens(logits: torch.Tensor, temperature: float,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One drafted token per row of ``logits [b, V]`` (fp32): argmax when greedy, else drawn from
    ``softmax(logits / temperature)`` (``torch.multinomial`` with ``generator``)."""
    if is_greedy(temperature):
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draft_probs(logits: torch.Tensor, temperatures: Optional[torch.Tensor]) -> torch.Tensor:
    """Draft probabilities ``[b, k, V]`` of the raw draft logits ``[b, k, V]``: ``softmax(logits /
    T)`` per row, ``T = 1`` for greedy rows and when ``temperatures`` is None (greedy drafts)."""
    if temperatures is None:
        t = torch.ones(logits.shape[0], device=logits.device)
    else:
        t = greedy_rows_as(temperatures[: logits.shape[0]].to(logits.device), 1.0)
    return torch.softmax(logits / t.view(-1, 1, 1), dim=-1)


__all__ = ["GREEDY_EPS", "draft_probs", "draft_temperatures", "greedy_rows_as", "is_greedy", "next_tokens"]
