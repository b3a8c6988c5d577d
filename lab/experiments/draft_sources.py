"""Which draft source should propose, round by round? Exact greedy replays of source policies.

    OMP_NUM_THREADS=1 .venv/bin/python lab/experiments/draft_sources.py \
        --workload benchmarks/workloads/heldout_agentic.jsonl --max-requests 24 --max-prompt-tokens 8192 \
        --out benchmarks/results/draft-sources-agentic

Under greedy decoding the target's output does not depend on the drafts, so one trace per request
fixes everything a round can see: for every anchor ``y_j`` of the greedy output (64 new tokens,
like ``ab.py``) it records

* DLite's K drafts from the target's features at the row that predicted ``y_j`` (HF target,
  teacher-forced: the rows vLLM hands the proposer after a verification) and the head's
  probability of each drafted token;
* vLLM's n-gram match (``prompt_lookup_min..max``: the numba matcher vLLM's ``NgramProposer``
  runs) on the context ``x_0..y_j``, and the longest n that matched;
* arctic-inference's suffix tree (vLLM's ``suffix`` method: the request's prompt and output so
  far, plus the earlier requests' outputs, with vLLM's default depth, spec factor and minimum
  probability) and its score;
* the true continuation ``y_{j+1}..`` (K tokens past the last emitted one, EOS or the 64th:
  vLLM's rejection sampler verifies drafts beyond it and its counters count the accepted ones).

A policy picks one draft per round; the replay walks the output round by round (a round at
anchor ``j`` that gets ``m`` drafts accepted moves to ``j + m + 1``), exactly as speculative
decoding would. Reported per policy, overall and by prompt length:

* ``tau``: vLLM's figure, 1 + accepted / rounds that carried a draft (rounds without a draft,
  where a matcher found nothing, are not counted, as in vLLM's metrics; drafts accepted past the
  last emitted token are counted, as vLLM counts them);
* ``tau_emitted``: the same without the drafts accepted past the last emitted token;
* ``tokens_per_step``: output tokens / target steps (every round counted): what throughput sees.

With ``--costs`` it also replays dlite-adaptive's controller at fixed step, token and draft costs
(one request at a time), next to fixed k and no speculation: what the decision logic does with
this drafter's head probabilities, apart from the noise of a shared machine.

The trace is the expensive part (one target prefill and decode per request); it is cached in
``OUT/trace.json`` and reused when the settings match. The drafts are the teacher-forced ones, so
they can differ from vLLM's in a last floating-point digit; ``ab.py`` measures the real thing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lab.buckets import PROMPT_BUCKETS  # noqa: E402  (after the path)
from vllm_dlite.vllm.adaptive.cost import (  # noqa: E402
    choose_source, expected_from_confidence, tree_before_drafting)


# =========================================================================== the trace
@dataclass
class Anchor:
    """What a round at anchor ``y_j`` can see, and the truth."""
    dlite: list[int]
    confidence: list[float]
    ngram: list[int]
    ngram_n: int  # longest n-gram that matched (0: none)
    suffix: list[int]
    suffix_score: float
    truth: list[int]  # y_{j+1} .. (up to K)


def ngram_match(context: np.ndarray, min_n: int, max_n: int, k: int, max_model_len: int) -> tuple[list[int], int]:
    """vLLM's n-gram matcher on one context, and the longest n that matched."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as match

    draft = [int(t) for t in match(context, min_n, max_n, max_model_len, k)]
    n = next((n for n in range(max_n, min_n - 1, -1) if len(match(context, n, n, max_model_len, k))), 0)
    return draft, (n if draft else 0)


def build_trace(args) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from transformers import AutoTokenizer
    from vllm.config import SpeculativeConfig

    from vllm_dlite.train.offline_eval import build_simulator
    from vllm_dlite.train.workloads.replay import load_replay

    tok = AutoTokenizer.from_pretrained(args.target)
    requests = load_replay(args.workload, tok, max_prompt_tokens=args.max_prompt_tokens)
    if args.max_requests and len(requests) > args.max_requests:
        step = len(requests) / args.max_requests
        requests = [requests[int(i * step)] for i in range(args.max_requests)]
    sim = build_simulator(args.target, args.dlite, device="cpu")
    ex, drafter = sim.extractor, sim.drafter
    K, G = int(drafter.config.num_draft_tokens), sim.group_size
    defaults = {f: SpeculativeConfig.__dataclass_fields__[f].default for f in (
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
        "suffix_decoding_max_cached_requests")}
    suffix = SuffixDecodingCache(max_tree_depth=defaults["suffix_decoding_max_tree_depth"],
                                 max_cached_requests=defaults["suffix_decoding_max_cached_requests"])
    max_model_len = args.max_prompt_tokens + args.max_tokens + K + 16
    out = []
    for r, req in enumerate(requests):
        prompt = list(req.prompt_token_ids)
        with torch.inference_mode():
            o = ex(torch.tensor([prompt]), use_cache=True)
            rows, output = [o.features[:, -1]], [int(ex.logits(o.final_hidden[0, -1:]).argmax(-1)[0])]
            # K tokens past the last emitted one (EOS or max_tokens): vLLM's rejection sampler
            # verifies drafts beyond it, and its counters count the accepted ones
            stop = args.max_tokens
            while len(output) < stop + K:
                if output[-1] in sim.eos_ids:
                    stop = min(stop, len(output))
                o = ex(torch.tensor([[output[-1]]]), past_key_values=o.past_key_values)
                rows.append(o.features[:, -1])
                output.append(int(ex.logits(o.final_hidden[0, -1:]).argmax(-1)[0]))
            after, output, rows = output[stop:], output[:stop], rows[:stop]
            seq = prompt + output
            P = len(prompt)
            groups = torch.tensor([[seq[max(0, P + j - G + 1 + i)] for i in range(G)] for j in range(len(output))])
            drafted = drafter.draft(torch.cat(rows), groups, k=K)
            probs = torch.softmax(drafted.logits.float(), -1)
            conf = probs.gather(-1, drafted.token_ids[..., None]).squeeze(-1)
        suffix.start_request(r, np.array(prompt, dtype=np.int32))
        anchors = []
        for j, y in enumerate(output):
            suffix.add_active_response(r, [y])
            ctx = np.array(seq[: P + j + 1], dtype=np.int32)
            ng, n = ngram_match(ctx, args.ngram_min, args.ngram_max, K, max_model_len)
            pattern = ctx[max(0, len(ctx) - defaults["suffix_decoding_max_tree_depth"]):]
            sd = suffix.speculate(r, pattern, max_spec_tokens=K,
                                  max_spec_factor=defaults["suffix_decoding_max_spec_factor"],
                                  min_token_prob=defaults["suffix_decoding_min_token_prob"])
            anchors.append(Anchor(dlite=drafted.token_ids[j].tolist(), confidence=[round(c, 5) for c in conf[j].tolist()],
                                  ngram=ng, ngram_n=n, suffix=[int(t) for t in sd.token_ids],
                                  suffix_score=round(float(sd.score), 5), truth=(output + after)[j + 1: j + 1 + K]))
        suffix.stop_request(r)
        out.append({"prompt_tokens": P, "output": output, "anchors": [vars(a) for a in anchors]})
        print(f"[trace] {r + 1}/{len(requests)}: {P} prompt tokens, {len(output)} new", flush=True)
    return {"settings": settings(args), "K": K, "requests": out}


def settings(args) -> dict:
    return {k: getattr(args, k) for k in ("workload", "target", "dlite", "max_requests", "max_prompt_tokens",
                                          "max_tokens", "ngram_min", "ngram_max")}


# =========================================================================== policies and the replay
Policy = Callable[[Anchor], list[int]]


def accepted(draft: list[int], truth: list[int]) -> int:
    m = 0
    while m < min(len(draft), len(truth)) and draft[m] == truth[m]:
        m += 1
    return m


def replay(anchors: list[Anchor], n_out: int, policy: Policy, k: int) -> tuple[int, int, int, int]:
    """(target steps, rounds with a draft, accepted drafts, accepted drafts that were emitted) of
    one request under ``policy``."""
    j = steps = drafted = acc = emitted = 0
    if hasattr(policy, "start"):
        policy.start()
    while j < n_out - 1:
        draft = policy(anchors[j])[:k]
        m = accepted(draft, anchors[j].truth)
        if hasattr(policy, "observe"):
            policy.observe(draft, m)
        steps += 1
        if draft:  # vLLM's counters: drafts accepted past the last emitted token count too
            drafted += 1
            acc += m
            emitted += min(m, n_out - 1 - j)
        j += m + 1
    return steps, drafted, acc, emitted


def confident(a: Anchor, threshold: float) -> list[int]:
    """DLite's draft up to the first token whose head probability is below ``threshold``."""
    n = 0
    while n < len(a.dlite) and a.confidence[n] >= threshold:
        n += 1
    return a.dlite[:n]


def hybrid(a: Anchor, factor: float = 1.0) -> list[int]:
    """dlite-hybrid's rule (``choose_source``): the suffix tree's draft when its score beats
    ``factor`` x DLite's expected accepted drafts (``factor`` != 1: how sensitive the rule is)."""
    expected = factor * expected_from_confidence(a.confidence)
    return a.suffix if choose_source(len(a.suffix), a.suffix_score, expected) == "suffix" else a.dlite


class HybridBeforeDrafting:
    """dlite-hybrid as served (``suffix_skip_factor``): before DLite drafts, the tree's draft when
    its score beats ``factor`` x DLite's expected accepted drafts from the request's running
    acceptance (the controller's :class:`AcceptanceStats`, fed by this request's DLite drafts and,
    through its prior, earlier requests'); otherwise :func:`hybrid` on the head probabilities.
    Stateful: ``replay`` starts each request and reports each outcome. ``skipped`` counts the
    rounds decided before drafting (no drafter needed)."""

    def __init__(self, k: int, factor: float):
        from vllm_dlite.vllm.adaptive import AdaptiveOptions
        from vllm_dlite.vllm.adaptive.cost import AcceptanceStats

        o = AdaptiveOptions()
        self.k, self.factor = k, factor
        self.stats = AcceptanceStats(k, o.prior_acceptance, o.prior_strength, o.request_decay, o.global_decay)
        self.request, self.skipped, self.source = 0, 0, None

    def start(self) -> None:
        self.stats.forget(str(self.request))
        self.request += 1

    def __call__(self, a: Anchor) -> list[int]:
        running = self.stats.cumulative(str(self.request), "dlite")[: self.k]
        if tree_before_drafting(a.suffix_score if a.suffix else None, running, self.factor):
            self.skipped += 1
            self.source = "suffix"
            return a.suffix
        draft = hybrid(a)
        self.source = "dlite" if draft is a.dlite else "suffix"
        return draft

    def observe(self, draft: list[int], m: int) -> None:
        if self.source == "dlite" and draft:
            self.stats.observe(str(self.request), "dlite", len(draft), m)


def best_of(a: Anchor, *drafts: list[int]) -> list[int]:
    return max(drafts, key=lambda d: accepted(d, a.truth))


def policies(k: int) -> dict[str, Policy]:
    """Each source alone, an oracle per pair (an upper bound: it knows the truth), fixed
    thresholds, the shipped rule and its sensitivity, the rule applied before drafting too (as
    served), and DLite's confidence cut."""
    p: dict[str, Policy] = {
        "dlite": lambda a: a.dlite,
        "ngram": lambda a: a.ngram,
        "suffix": lambda a: a.suffix,
        "oracle: best of ngram, dlite": lambda a: best_of(a, a.ngram, a.dlite),
        "oracle: best of suffix, dlite": lambda a: best_of(a, a.suffix, a.dlite),
    }
    for n in (3, 4):
        p[f"ngram if match >= {n} tokens, else dlite"] = lambda a, n=n: a.ngram if a.ngram_n >= n else a.dlite
    for s in (1.0, 2.0):
        p[f"suffix if score > {s:g}, else dlite"] = lambda a, s=s: a.suffix if a.suffix and a.suffix_score > s else a.dlite
    p["ngram if longer than dlite's expected, else dlite"] = (
        lambda a: a.ngram if a.ngram and len(a.ngram) > expected_from_confidence(a.confidence) else a.dlite)
    p["ngram unless dlite's first token is sure (> 0.7) and differs"] = lambda a: (
        a.dlite if not a.ngram or (a.ngram[0] != a.dlite[0] and a.confidence[0] > 0.7) else a.ngram)
    p["dlite-hybrid: suffix if score > dlite's expected"] = hybrid
    for f in (0.5, 0.75, 1.5):
        p[f"  the same with {f:g} x dlite's expected"] = lambda a, f=f: hybrid(a, f)
    for f in (1.0, 1.5, 2.0):
        p[f"dlite-hybrid, and the tree before drafting if score > {f:g} x dlite's running expected"] = (
            HybridBeforeDrafting(k, f))
    for t in (0.05, 0.3):
        p[f"dlite cut at head probability {t:g}"] = lambda a, t=t: confident(a, t)
    return p


def evaluate(trace: dict, k: Optional[int] = None) -> dict:
    k = k or trace["K"]
    report = {}
    for name in policies(k):
        rows = {}
        for label, lo, hi in (("overall", 0, 1 << 30), *PROMPT_BUCKETS):
            reqs = [r for r in trace["requests"] if lo <= r["prompt_tokens"] < hi]
            if not reqs:
                continue
            policy = policies(k)[name]  # a fresh one: some keep state across a bucket's requests
            steps = drafted = acc = emitted = out = 0
            for r in reqs:
                s, d, a, e = replay([Anchor(**x) for x in r["anchors"]], len(r["output"]), policy, k)
                steps, drafted, acc, emitted = steps + s, drafted + d, acc + a, emitted + e
                out += len(r["output"]) - 1
            rows[label] = {"tau": round(1 + acc / drafted, 3) if drafted else None,
                           "tau_emitted": round(1 + emitted / drafted, 3) if drafted else None,
                           "tokens_per_step": round(out / steps, 3) if steps else None,
                           "draft_rounds": drafted, "steps": steps, "requests": len(reqs)}
            if isinstance(policy, HybridBeforeDrafting):
                rows[label]["rounds_without_dlite"] = policy.skipped
        report[name] = rows
    return report


# =========================================================================== dlite-adaptive at given costs
def decode_rate(trace: dict, costs: tuple[float, float, float], k: int = 0, adaptive: bool = False) -> dict:
    """Decode tokens/s of DLite proposing ``k`` tokens every round (0: no speculation), or of
    dlite-adaptive's controller (``adaptive``), one request at a time, when a target step costs
    ``step + token x drafts`` seconds and a draft round ``draft`` (prefill not counted). The
    controller sees a clock that advances by those costs and fits its own cost model from it, as
    in vLLM; the head probabilities and the outcomes are the trace's."""
    from vllm_dlite.vllm.adaptive import AdaptiveController, AdaptiveOptions

    step_s, token_s, draft_s = costs
    K = trace["K"]
    now = [0.0]
    ctl = AdaptiveController(AdaptiveOptions.from_dict("adaptive"), K, clock=lambda: now[0]) if adaptive else None
    seconds = tokens = rounds = drafted = 0
    for r_i, r in enumerate(trace["requests"]):
        rid, anchors, n = f"r{r_i}", [Anchor(**x) for x in r["anchors"]], len(r["output"])
        j, scheduled, rejected, query = 0, 0, None, r["prompt_tokens"]
        now[0] += 1.0  # the prefill: not a decode step, not counted
        while j < n - 1:
            a = anchors[j]
            if ctl is None:
                length, ran = k, k > 0
            else:
                ctl.begin_round([rid], [scheduled], [query], rejected, live_req_ids={rid}, now=now[0])
                plan = ctl.plan([rid], K)
                ran = bool(plan.dlite_rows)
                now[0] += draft_s if ran else 0.0
                lengths, sources = ctl.select(plan, [rid], K, {0: a.confidence} if ran else {})
                ctl.end_round([rid], sources, lengths, plan.phase, len(plan.dlite_rows),
                              draft_s if ran else None, now=now[0])
                length = lengths[0]
            m = accepted(a.dlite[:length], a.truth)
            step = step_s + token_s * length
            now[0] += step
            seconds += step + (draft_s if ran else 0.0)
            rounds, drafted = rounds + 1, drafted + (length > 0)
            scheduled, rejected, query = length, ([length - m] if length else None), 1 + length
            j += m + 1
        tokens += n - 1
    return {"tokens_per_s": round(tokens / seconds, 1), "rounds": rounds, "rounds_with_drafts": drafted}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--dlite", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--max-requests", type=int, default=24)
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ngram-min", type=int, default=2, help="ab.py's n-gram method uses 2..5")
    ap.add_argument("--ngram-max", type=int, default=5)
    ap.add_argument("--costs", default=None, metavar="STEP_MS,TOKEN_MS,DRAFT_MS",
                    help="also report decode tokens/s at these costs (e.g. the cost model ab.py reports for "
                         "dlite-adaptive): no speculation, fixed k = 2, 4, K, and dlite-adaptive's controller")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "trace.json"
    trace = json.loads(path.read_text()) if path.exists() else None
    if trace is None or trace["settings"] != settings(args):
        trace = build_trace(args)
        path.write_text(json.dumps(trace))
    report = {"settings": trace["settings"] | {"command": "python lab/experiments/draft_sources.py " + " ".join(
        argv if argv is not None else sys.argv[1:])}, "policies": evaluate(trace)}
    if args.costs:
        costs = tuple(float(c) / 1e3 for c in args.costs.split(","))
        report["decode_at_costs"] = {"costs_ms": args.costs, **{
            name: decode_rate(trace, costs, k, adaptive) for name, k, adaptive in (
                ("none", 0, False), ("dlite@2", 2, False), ("dlite@4", 4, False),
                (f"dlite (k {trace['K']})", trace["K"], False), ("dlite-adaptive", 0, True))}}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    labels = [name for name, _, _ in PROMPT_BUCKETS]
    print(f"{'policy':62s} {'tau':>6s} {'emitted':>7s} {'tok/step':>8s}  " + "  ".join(f"{l:>13s}" for l in labels))
    print(f"{'':62s} {'':>6s} {'':>7s} {'':>8s}  " + "  ".join(f"{'tau/tok/step':>13s}" for l in labels))
    for name, rows in report["policies"].items():
        o = rows["overall"]
        by = "  ".join(f"{rows[l]['tau'] or 0:6.2f}/{rows[l]['tokens_per_step']:6.2f}" if l in rows else f"{'-':>13s}"
                       for l in labels)
        print(f"{name:62s} {o['tau'] or 0:6.2f} {o['tau_emitted'] or 0:7.2f} {o['tokens_per_step']:8.2f}  {by}")
    for name, rows in report["policies"].items():
        if "rounds_without_dlite" in rows["overall"]:
            o = rows["overall"]
            print(f"{name}: decided before drafting (no DLite draft) in {o['rounds_without_dlite']} of {o['steps']} rounds")
    if args.costs:
        print(f"\ndecode tokens/s, one request at a time, step,token,draft = {args.costs} ms:")
        for name, r in report["decode_at_costs"].items():
            if name != "costs_ms":
                print(f"  {name:16s} {r['tokens_per_s']:7.1f}  ({r['rounds_with_drafts']} of {r['rounds']} rounds drafted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
