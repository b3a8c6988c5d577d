"""The hybrid's second draft source: arctic-inference's suffix tree (the one vLLM's ``"suffix"``
method uses) over each request's context."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from vllm_dlite.vllm.adaptive.options import AdaptiveOptions


class Match(NamedTuple):
    """A suffix-tree draft: tokens, the tree's cumulative probability of each, their sum."""
    tokens: list
    probs: list
    score: float


class SuffixSource:
    """arctic-inference's suffix tree over each request's context, kept as vLLM's ``"suffix"`` method
    keeps it: a request's tree starts from its prompt and grows with its output; a finished request's
    output stays cached (up to ``suffix_max_cached_requests``) for the requests after it."""

    def __init__(self, options: AdaptiveOptions, max_model_len: int):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.options, self.max_model_len = options, max_model_len
        self.cache = SuffixDecodingCache(max_tree_depth=options.suffix_max_tree_depth,
                                         max_cached_requests=options.suffix_max_cached_requests)
        self._seen: dict[str, int] = {}  # req_id -> context tokens already in its tree

    def draft(self, req_id: str, context: np.ndarray, num_prompt_tokens: int, k: int) -> Optional[Match]:
        """The tree's draft after ``context`` (prompt + output up to the anchor), or None while the
        request is still prefilling (its anchor is not a token of the output yet)."""
        if len(context) <= num_prompt_tokens:
            return None
        if req_id not in self.cache.active_requests:
            if req_id in self.cache.cached_requests:  # a request id used again
                self.cache.evict_cached_response(req_id)
            self.cache.start_request(req_id, context[:num_prompt_tokens])
            self._seen[req_id] = num_prompt_tokens
        if len(context) > self._seen[req_id]:
            self.cache.add_active_response(req_id, context[self._seen[req_id]:])
            self._seen[req_id] = len(context)
        o = self.options
        d = self.cache.speculate(req_id, context[max(0, len(context) - o.suffix_max_tree_depth):],
                                 max_spec_tokens=min(k, self.max_model_len - len(context) - 1),
                                 max_spec_factor=o.suffix_max_spec_factor, min_token_prob=o.suffix_min_token_prob)
        return Match(list(d.token_ids), list(d.probs), float(d.score)) if d.token_ids else None

    def retire(self, live_req_ids) -> None:
        """Requests that left the batch: their outputs stay cached for later requests."""
        for req_id in [r for r in self.cache.active_requests if r not in live_req_ids]:
            self.cache.stop_request(req_id)
            self._seen.pop(req_id, None)


__all__ = ["Match", "SuffixSource"]
