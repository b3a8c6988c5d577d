"""Offline acceptance estimator: greedy speculative decoding simulated with HF transformers.

    python -m vllm_dlite.train.offline_eval --target T --drafter D --workload W.jsonl [W2.jsonl ...] \
        --k 7 --max-new-tokens 256 --out report.json

No vLLM: the target runs in PyTorch with its KV cache (HF ``DynamicCache``), so the numbers are
available before (and independently of) the serving integration. For every replay request
(:mod:`vllm_dlite.train.workloads.replay`: one request per assistant turn, prompt = rendered history):

1. prefill the prompt; the target's argmax is the first new token ``y_1`` (the first anchor), the
   last prompt row gives its features;
2. each ROUND, with anchor ``x_a`` at position ``a``: draft K tokens with
   ``DLiteDrafter.draft(features at a-1, group_ids = x_{a-g+1..a})`` (``g = min(G, a+1)``: the
   anchor alone for G = 1, ``x_{a-1}, x_a`` for G = 2; features = the vLLM aux ids
   ``config.aux_layer_ids``, pre-norm, exactly what vLLM hands the proposer); verify
   ``[x_a, d_1..d_K]`` in ONE cached target forward; accept the longest prefix with
   ``d_i == argmax`` of the target, then append the target's own token (bonus / correction);
   crop the cache to the accepted prefix; the next anchor's features are the verify forward's row
   that predicted it;
3. stop at EOS (kept) or ``max_new_tokens``.

The output is exactly the target's greedy output (lossless by construction; ``--check-lossless``
also runs plain greedy decoding and compares, which doubles the cost).

Statistics (vLLM's conventions): per round, ``accepted`` = drafts kept (capped where generation
stops, so a final round contributes only tokens that are emitted); ``tau = 1 + accepted / rounds``
(the bonus token counted); per-position acceptance rate ``P(position i accepted) =
#rounds with accepted >= i / rounds``. Reported overall and per workload kind, as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from vllm_dlite.train.features import TargetFeatureExtractor, crop_cache, torch_dtype


@dataclass
class RequestResult:
    """One simulated request. ``accepted`` has one entry per verification round."""

    id: str
    kind: str
    prompt_len: int
    output_ids: list[int]
    accepted: list[int] = field(default_factory=list)
    target_s: float = 0.0
    draft_s: float = 0.0
    lossless: Optional[bool] = None

    @property
    def rounds(self) -> int:
        return len(self.accepted)


def eos_token_ids(model: Any) -> set[int]:
    """EOS ids of an HF model (generation config first, then the model config)."""
    ids: Any = None
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        ids = gen.eos_token_id
    if ids is None:
        ids = getattr(model.config, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])}


def _argmax_tokens(extractor: TargetFeatureExtractor, final_hidden: torch.Tensor) -> torch.Tensor:
    """Post-norm rows ``[n, H]`` -> greedy tokens ``[n]``."""
    return extractor.logits(final_hidden).argmax(dim=-1)


class SpeculativeSimulator:
    """Greedy DLite speculative decoding of one request at a time on an HF target.

    ``drafter`` is a :class:`~vllm_dlite.model.DLiteDrafter` (``config.aux_layer_ids``,
    ``config.num_draft_tokens``, ``config.anchor_group_size``, ``draft(features [1, L, H],
    group_ids [1, g], k=k)``) bound to the target; the extractor must have been built
    with the drafter's aux layer ids. ``k <= K = B-1`` drafts per round.
    """

    def __init__(self, extractor: TargetFeatureExtractor, drafter: Any, k: Optional[int] = None,
                 eos_ids: Optional[Iterable[int]] = None):
        K = int(drafter.config.num_draft_tokens)
        self.k = K if k is None else int(k)
        if not 1 <= self.k <= K:
            raise ValueError(f"k must be in 1..{K} (the drafter's B-1), got {k}")
        if list(extractor.layer_ids) != list(drafter.config.aux_layer_ids):
            raise ValueError(
                f"extractor layer ids {extractor.layer_ids} != the drafter's vLLM aux ids "
                f"{drafter.config.aux_layer_ids}"
            )
        self.group_size = int(drafter.config.anchor_group_size)
        self.extractor = extractor
        self.drafter = drafter
        self.eos_ids = set(eos_ids) if eos_ids is not None else eos_token_ids(extractor.model)

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, request_id: str = "",
                 kind: str = "") -> RequestResult:
        ex, device = self.extractor, self.extractor.device
        result = RequestResult(request_id, kind, len(prompt_ids), [])
        if max_new_tokens <= 0:
            return result
        t0 = time.perf_counter()
        out = ex(torch.tensor(prompt_ids, dtype=torch.long, device=device)[None], use_cache=True)
        cache = out.past_key_values
        first = int(_argmax_tokens(ex, out.final_hidden[0, -1:])[0])
        features = out.features[:, -1]  # [1, L, H]: row of the last prompt token
        result.target_s += time.perf_counter() - t0
        output = [first]
        prompt = list(prompt_ids)
        while output[-1] not in self.eos_ids and len(output) < max_new_tokens:
            anchor = output[-1]
            t0 = time.perf_counter()
            a = len(prompt) + len(output) - 1  # the anchor's position
            g = min(self.group_size, a + 1)
            group = (prompt + output)[a - g + 1 : a + 1]
            drafted = self.drafter.draft(features, torch.tensor([group], device=device),
                                         k=self.k)
            draft_ids = drafted.token_ids[0, : self.k].tolist()
            result.draft_s += time.perf_counter() - t0

            t0 = time.perf_counter()
            verify_in = torch.tensor([[anchor] + draft_ids], dtype=torch.long, device=device)
            cached_before = cache.get_seq_length()  # = position of the anchor
            vo = ex(verify_in, past_key_values=cache)
            target_ids = _argmax_tokens(ex, vo.final_hidden[0]).tolist()  # [k + 1]
            accepted = 0
            while accepted < self.k and draft_ids[accepted] == target_ids[accepted]:
                accepted += 1
            new_tokens = draft_ids[:accepted] + [target_ids[accepted]]
            emitted = 0
            for token in new_tokens:  # stop exactly where plain greedy decoding would
                output.append(token)
                emitted += 1
                if token in self.eos_ids or len(output) >= max_new_tokens:
                    break
            result.accepted.append(min(accepted, emitted))
            # keep anchor + accepted drafts; the bonus becomes the next (uncached) anchor
            crop_cache(cache, cached_before + accepted + 1)
            features = vo.features[:, accepted]  # row that predicted the bonus token
            result.target_s += time.perf_counter() - t0
        result.output_ids = output
        return result


@torch.no_grad()
def greedy_generate(extractor: TargetFeatureExtractor, prompt_ids: Sequence[int],
                    max_new_tokens: int, eos_ids: Iterable[int]) -> list[int]:
    """Plain greedy decoding with the KV cache, one token per step (the lossless reference)."""
    eos = set(eos_ids)
    device = extractor.device
    out = extractor(torch.tensor(prompt_ids, dtype=torch.long, device=device)[None],
                    use_cache=True)
    output: list[int] = []
    while True:
        token = int(_argmax_tokens(extractor, out.final_hidden[0, -1:])[0])
        output.append(token)
        if token in eos or len(output) >= max_new_tokens:
            return output
        out = extractor(torch.tensor([[token]], device=device), past_key_values=out.past_key_values)


def build_simulator(target: Union[str, Path], drafter: Union[str, Path, Any], k: Optional[int] = None,
                    *, device: str = "cpu", dtype: Union[str, torch.dtype, None] = None,
                    eos_ids: Optional[Iterable[int]] = None) -> SpeculativeSimulator:
    """Target (HF, serving the drafter's vLLM aux ids) + drafter (a checkpoint directory, loaded
    in the target's dtype, or a DLiteDrafter) bound to the target's embedding and final norm."""
    from vllm_dlite.model import load_drafter

    target_dtype = torch_dtype(dtype)
    model = load_drafter(drafter, device=device, dtype=target_dtype or torch.float32) \
        if isinstance(drafter, (str, Path)) else drafter
    extractor = TargetFeatureExtractor.from_pretrained(
        target, model.config.aux_layer_ids, dtype=target_dtype, device=device
    )
    norm_weight, eps = extractor.final_norm
    model.bind_target(extractor.embed_weight.to(model.dtype), norm_weight.to(model.dtype), eps)
    return SpeculativeSimulator(extractor, model, k, eos_ids)


def summarize(results: Sequence[RequestResult], k: int) -> dict[str, Any]:
    """Aggregate statistics (see the module docstring)."""
    rounds = sum(r.rounds for r in results)
    accepted = sum(sum(r.accepted) for r in results)
    per_position = [sum(1 for r in results for a in r.accepted if a >= i) for i in range(1, k + 1)]
    checked = [r.lossless for r in results if r.lossless is not None]
    return dict(
        requests=len(results),
        rounds=rounds,
        accepted=accepted,
        tau=round(1 + accepted / rounds, 4) if rounds else None,
        acceptance_rate_per_position=[round(c / rounds, 4) for c in per_position]
        if rounds else None,
        new_tokens=sum(len(r.output_ids) for r in results),
        mean_prompt_tokens=round(sum(r.prompt_len for r in results) / len(results), 1)
        if results else None,
        target_s=round(sum(r.target_s for r in results), 3),
        draft_s=round(sum(r.draft_s for r in results), 3),
        lossless=all(checked) if checked else None,
    )


def select_requests(requests: list, max_per_kind: Optional[int]) -> list:
    """Up to ``max_per_kind`` requests per kind, evenly spread over the list (short and long
    prompts of agentic sessions alike); order kept."""
    by_kind: dict[str, list] = {}
    for r in requests:
        by_kind.setdefault(r.kind, []).append(r)
    chosen = []
    for reqs in by_kind.values():
        if max_per_kind is None or len(reqs) <= max_per_kind:
            chosen.extend(reqs)
        else:
            step = len(reqs) / max_per_kind
            chosen.extend(reqs[int(i * step)] for i in range(max_per_kind))
    return chosen


def load_requests(tokenizer, workloads: Sequence[str] = (), kinds: Optional[dict] = None,
                  split: str = "heldout", seed: int = 1, max_prompt_tokens: Optional[int] = None,
                  max_requests_per_kind: Optional[int] = None) -> list:
    """Replay requests from workload JSONL files and/or freshly generated sessions."""
    from vllm_dlite.train.workloads.generator import generate_named
    from vllm_dlite.train.workloads.replay import replay_requests
    from vllm_dlite.train.workloads.schema import read_sessions

    sessions: list[dict] = []
    for path in workloads:
        sessions.extend(read_sessions(path))
    for kind, n in (kinds or {}).items():
        if n > 0:
            sessions.extend(generate_named(kind, split, n, seed))
    requests = replay_requests(sessions, tokenizer, max_prompt_tokens=max_prompt_tokens)
    return select_requests(requests, max_requests_per_kind)


def evaluate(
    target: Union[str, Path],
    drafter: Union[str, Path, Any],
    *,
    workloads: Sequence[str] = (),
    kinds: Optional[dict[str, int]] = None,
    split: str = "heldout",
    seed: int = 1,
    k: Optional[int] = None,
    max_new_tokens: int = 256,
    max_prompt_tokens: Optional[int] = None,
    max_requests_per_kind: Optional[int] = None,
    check_lossless: bool = True,
    device: str = "cpu",
    dtype: Optional[str] = None,
    progress: bool = True,
    keep_requests: bool = False,
) -> dict[str, Any]:
    """Run the simulator over the requests; return the JSON-able report."""
    from transformers import AutoTokenizer

    t_start = time.time()
    sim = build_simulator(target, drafter, k, device=device, dtype=dtype)
    extractor = sim.extractor
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    requests = load_requests(tokenizer, workloads, kinds, split, seed, max_prompt_tokens,
                             max_requests_per_kind)
    iterator: Iterable = requests
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(requests, desc="offline spec-decode", unit="req", file=sys.stderr)
    results = []
    for req in iterator:
        res = sim.generate(req.prompt_token_ids, max_new_tokens,
                           f"{req.session_id}#{req.turn}", req.kind)
        if check_lossless:
            ref = greedy_generate(extractor, req.prompt_token_ids, max_new_tokens, sim.eos_ids)
            res.lossless = ref == res.output_ids
        results.append(res)
    per_kind = {kind: summarize([r for r in results if r.kind == kind], sim.k)
                for kind in sorted({r.kind for r in results})}
    report = dict(
        settings=dict(target=str(target), drafter=str(drafter) if isinstance(
            drafter, (str, Path)) else type(drafter).__name__, k=sim.k, temperature=0.0,
            batch_size=1, device=device, dtype=str(extractor.dtype).removeprefix("torch."),
            max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
            workloads=list(workloads), kinds=dict(kinds or {}), split=split, seed=seed,
            max_requests_per_kind=max_requests_per_kind, torch_threads=torch.get_num_threads()),
        overall=summarize(results, sim.k),
        per_kind=per_kind,
        wall_s=round(time.time() - t_start, 1),
    )
    if keep_requests:
        report["requests"] = [
            dict(asdict(r), rounds=r.rounds) for r in results
        ]
    return report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_dlite.train.offline_eval", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--target", required=True, help="HF target model directory")
    ap.add_argument("--drafter", required=True, help="DLite checkpoint directory")
    ap.add_argument("--workload", nargs="*", default=[], help="workload JSONL file(s)")
    ap.add_argument("--kinds", nargs="*", default=[], metavar="KIND=N",
                    help="also generate N sessions of KIND (split --split, seed --seed)")
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--k", type=int, default=None, help="drafts per round (default: block size)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=None)
    ap.add_argument("--max-requests-per-kind", type=int, default=None)
    ap.add_argument("--no-check-lossless", dest="check_lossless", action="store_false",
                    help="skip the plain-greedy comparison (halves the run time)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="target dtype (default fp32 on CPU)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--per-request", action="store_true", help="include per-request results")
    ap.add_argument("--out", default=None, help="write the JSON report here (default: stdout)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.workload and not args.kinds:
        ap.error("give --workload FILE(s) and/or --kinds KIND=N")
    kinds = {k: int(v) for k, v in (item.split("=", 1) for item in args.kinds)}
    report = evaluate(
        args.target, args.drafter, workloads=args.workload, kinds=kinds, split=args.split,
        seed=args.seed, k=args.k, max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        max_requests_per_kind=args.max_requests_per_kind, check_lossless=args.check_lossless,
        device=args.device, dtype=args.dtype, keep_requests=args.per_request,
    )
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    lossless = report["overall"]["lossless"]
    return 0 if lossless in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
