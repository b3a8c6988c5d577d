"""Replay requests through a fresh vLLM engine with one speculative method; read its metrics.

Shared by ``benchmarks/ab.py``, ``benchmarks/gpu_check.py`` and the tests so that every method runs
with identical engine settings (built by :mod:`vllm_dlite.vllm.engine`). Terms (vLLM's conventions):

* ``num_drafts``: verification rounds that carried a draft; ``accepted``: draft tokens accepted.
* ``tau`` (mean acceptance length) = tokens produced per target verification, counting the bonus
  token = ``1 + accepted / num_drafts``.
* ``tau_per_position[i]``: fraction of drafts whose position ``i`` (0-based) was accepted.
* ``kv_pool_tokens``: the KV-cache capacity in tokens as vLLM computes and logs it (all KV groups).
* ``request_spec``: per request, vLLM's own per-request acceptance record
  (``RequestOutput.outputs[0].spec_decode_metrics``, ``vllm/v1/metrics/stats.py``
  ``RequestSpecDecodeMetrics``, enabled by ``per_request_spec_decode_metrics="summary"``):
  ``histogram[j]`` = verify steps of that request in which exactly ``j`` draft tokens were accepted,
  so drafts = ``sum(histogram)``, accepted = ``sum(j * histogram[j])`` and position ``i`` (0-based)
  was accepted in ``sum(histogram[i+1:])`` drafts.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from vllm_dlite.vllm.engine import build_llm, shutdown


@dataclass
class RunResult:
    method: str
    outputs: list[list[int]]                      # generated token ids per request
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    mean_itl_ms: float                            # mean inter-token latency over requests
    kv_pool_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_tokens: int = 0
    tau: float | None = None
    tau_per_position: list[float] = field(default_factory=list)
    # per request: {"prompt_tokens", "histogram", "draft_tokens"} (histogram empty without speculation)
    request_spec: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        d.pop("request_spec")
        return d


def request_spec_record(output) -> dict:
    """One ``RequestOutput``'s prompt length and vLLM's per-request acceptance histogram (empty
    when the engine ran without speculation or without per-request spec-decode metrics)."""
    m = output.outputs[0].spec_decode_metrics if output.outputs else None
    return {"prompt_tokens": len(output.prompt_token_ids or ()),
            "histogram": list(m.histogram) if m is not None else [],
            "draft_tokens": int(m.num_draft_tokens) if m is not None else 0}


def spec_decode_counters(llm) -> dict:
    """Spec-decode counters from ``LLM.get_metrics()`` (requires ``disable_log_stats=False``)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in names:
            out[names[m.name]] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            out["per_pos"] = [a + b for a, b in zip(vals, out["per_pos"])] if out["per_pos"] else vals
    return out


def kv_pool_tokens(llm) -> int:
    """The target's KV capacity in tokens as vLLM logs it ("KV cache size: N tokens"): group-aware,
    so a drafter with its own KV layers (EAGLE-3, DFlash) shows up as a smaller pool. Blocks x block
    size is not: with several KV-cache groups the block count is per group."""
    cache = llm.llm_engine.vllm_config.cache_config
    tokens = getattr(cache, "kv_cache_size_tokens", None)
    if tokens:
        return int(tokens)
    return int((cache.num_gpu_blocks or 0) * cache.block_size)


def run_replay(llm, method: str, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0,
               seed: int = 0) -> RunResult:
    """Generate for every prompt (one batch; the engine schedules up to ``max_num_seqs`` at once)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed if temperature else None)
    before = spec_decode_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = spec_decode_counters(llm)
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(map(len, outputs))
    itls = []
    for o in outs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        first, last = getattr(m, "first_token_ts", None), getattr(m, "last_token_ts", None)
        if m is not None and first and last and n > 1:
            itls.append((last - first) / (n - 1) * 1000)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] or [0] * len(after["per_pos"]))]
    return RunResult(
        method=method, outputs=outputs, wall_s=wall, output_tokens=n_out,
        output_tokens_per_s=n_out / wall if wall else 0.0,
        mean_itl_ms=sum(itls) / len(itls) if itls else float("nan"),
        kv_pool_tokens=kv_pool_tokens(llm), num_drafts=int(drafts),
        num_draft_tokens=int(after["draft_tokens"] - before["draft_tokens"]), accepted_tokens=int(accepted),
        tau=(1 + accepted / drafts) if drafts else None,
        tau_per_position=[p / drafts for p in per_pos] if drafts else [],
        request_spec=[request_spec_record(o) for o in outs],
    )


def is_decode_step(scheduler_output) -> bool:
    """Every request of the step is decoding: scheduled exactly its last sampled token plus its
    drafts (none when the drafter proposed nothing), so no prefill chunk is in the batch."""
    scheduled = scheduler_output.num_scheduled_tokens  # req id -> tokens this step
    drafts = scheduler_output.scheduled_spec_decode_tokens  # req id -> draft token ids
    return bool(scheduled) and all(n == 1 + len(drafts.get(r, ())) for r, n in scheduled.items())


class DraftTimer:
    """Times every draft round inside vLLM's V1 model runner (in-process engine only:
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), whatever the method.

    Wraps ``GPUModelRunner.propose_draft_token_ids`` (the CPU runner inherits it) and, inside it,
    the drafter's own ``propose``. Each record is a :class:`DraftRound`. ``verifying`` rounds follow
    a target step in which every request was decoding (it was scheduled its last token plus its
    drafts): steady state. The others follow a step in which some request prefilled a chunk; there
    vLLM's runner first concatenates the aux hidden states of every scheduled token (a cost that
    grows with the chunk, ~4k tokens per chunk here) and the drafts of a partial chunk are
    discarded. vLLM 0.32 passes ``spec_decode_metadata`` on prefill steps too, so the schedule, not
    that argument, tells the two apart. On CUDA the device is synchronised around each call so the
    time is the draft's, not a launch's.
    """

    def __init__(self):
        self.records: list[DraftRound] = []
        self._original = None

    def __enter__(self) -> "DraftTimer":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        original = self._original = GPUModelRunner.propose_draft_token_ids
        records = self.records

        def timed(runner, *args, **kwargs):
            import torch

            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            batch = runner.input_batch
            n = batch.num_reqs
            context = int(batch.num_tokens_no_spec[:n].max()) if n else 0
            scheduler_output = kwargs.get("scheduler_output", args[0] if args else None)
            decoding = is_decode_step(scheduler_output)
            drafter, inner = getattr(runner, "drafter", None), [0.0]
            propose = getattr(drafter, "propose", None)
            if propose is not None:
                def timed_propose(*a, **kw):
                    t = time.perf_counter()
                    try:
                        return propose(*a, **kw)
                    finally:
                        sync()
                        inner[0] += time.perf_counter() - t
                drafter.propose = timed_propose
            sync()
            t0 = time.perf_counter()
            try:
                out = original(runner, *args, **kwargs)
                sync()
            finally:
                if propose is not None:
                    del drafter.propose  # back to the class's method
            records.append(DraftRound(time.perf_counter() - t0, inner[0], n, context, decoding,
                                      sampled_counts(args[1] if len(args) > 1 else kwargs["sampled_token_ids"], n),
                                      tuple(batch.req_ids[:n]),
                                      tuple(len(scheduler_output.scheduled_spec_decode_tokens.get(r, ()))
                                            for r in batch.req_ids[:n])))
            return out

        GPUModelRunner.propose_draft_token_ids = timed
        return self

    def __exit__(self, *exc) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        GPUModelRunner.propose_draft_token_ids = self._original


class DraftRound(NamedTuple):
    seconds: float          # the whole runner call: input preparation + the drafter + bookkeeping
    drafter_seconds: float  # the drafter's own propose()
    num_requests: int
    context: int            # longest context in the batch, tokens
    verifying: bool         # every request of the step was decoding (steady state), see is_decode_step
    # per request of the batch: tokens the target step before this round gave it (after a
    # verification: accepted drafts + 1; after a prefill chunk: 1, or 0 for a partial chunk on the
    # list path); empty where not known (V2)
    sampled: tuple = ()
    req_ids: tuple = ()
    drafted: tuple = ()     # per request: draft tokens the step before this round verified


def sampled_counts(sampled_token_ids, n: int) -> tuple:
    """Tokens per request in the runner's ``sampled_token_ids`` (V1): lists of valid ids, or a
    ``[num_reqs, k + 1]`` tensor padded with the rejection sampler's placeholder -1."""
    if isinstance(sampled_token_ids, list):
        return tuple(len(t) for t in sampled_token_ids[:n])
    return tuple(int(c) for c in (sampled_token_ids[:n] != -1).sum(dim=1).tolist())


class EventDraftTimer:
    """Draft rounds on Model Runner V2 on CUDA: CUDA events around ``runner.speculator.propose`` (no
    host sync, so throughput is not disturbed); in-process engine only. ``records`` (read after
    ``__exit__``): :class:`DraftRound` tuples with ``seconds == drafter_seconds``, ``context`` 0 (not
    known here) and ``verifying`` = the batch held at most ``k + 1`` tokens per request (steady state)."""

    def __init__(self, llm, k: int):
        self.llm, self.k, self.records, self._raw, self._spec = llm, k, [], [], None

    def __enter__(self) -> "EventDraftTimer":
        raw = self._raw

        def patch(worker):
            spec = getattr(worker.model_runner, "speculator", None)
            if spec is None or not hasattr(spec, "propose"):
                return None
            import torch

            original = spec.propose

            def timed(*a, **kw):
                batch = kw.get("input_batch", a[0] if a else None)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = original(*a, **kw)
                end.record()
                raw.append((start, end, int(getattr(batch, "num_reqs", 0)), int(getattr(batch, "num_tokens", 0))))
                return out

            spec.propose = timed
            return spec

        self._spec = self.llm.collective_rpc(patch)[0]
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self._spec is not None and "propose" in vars(self._spec):
            del self._spec.propose
        torch.cuda.synchronize()
        for s, e, n, t in self._raw:
            ms = s.elapsed_time(e)
            self.records.append(DraftRound(ms / 1000, ms / 1000, n, 0, t <= n * (self.k + 1)))
        self._raw.clear()


class NoDraftTimer:
    """Model Runner V2 on CPU: its draft rounds run through Triton's interpreter, so they are not
    timed (and vLLM 0.34 has no V1 runner for :class:`DraftTimer` to wrap)."""

    def __init__(self):
        self.records: list = []

    def __enter__(self) -> "NoDraftTimer":
        return self

    def __exit__(self, *exc) -> None:
        pass


def draft_timer(llm, runner: str, k: int):
    """The draft-round timer for this engine: :class:`DraftTimer` on V1, CUDA events on Model Runner
    V2 on CUDA (:class:`EventDraftTimer`), none on V2 on CPU (:class:`NoDraftTimer`)."""
    import torch

    if runner == "v1":
        return DraftTimer()
    return EventDraftTimer(llm, k) if torch.cuda.is_available() else NoDraftTimer()


def merge_runs(method: str, runs: list[RunResult]) -> RunResult:
    """One :class:`RunResult` from consecutive replays on one engine (waves): sums, tok/s over the
    summed wall time, ITL weighted by requests, per-position acceptance weighted by drafts."""
    drafts = sum(r.num_drafts for r in runs)
    accepted = sum(r.accepted_tokens for r in runs)
    wall, tokens = sum(r.wall_s for r in runs), sum(r.output_tokens for r in runs)
    itl = [(r.mean_itl_ms, len(r.outputs)) for r in runs if r.mean_itl_ms == r.mean_itl_ms]  # not NaN
    width = max((len(r.tau_per_position) for r in runs), default=0)
    return RunResult(
        method=method, outputs=[o for r in runs for o in r.outputs], wall_s=wall, output_tokens=tokens,
        output_tokens_per_s=tokens / wall if wall else 0.0,
        mean_itl_ms=sum(m * n for m, n in itl) / sum(n for _, n in itl) if itl else float("nan"),
        kv_pool_tokens=runs[0].kv_pool_tokens if runs else 0, num_drafts=drafts,
        num_draft_tokens=sum(r.num_draft_tokens for r in runs), accepted_tokens=accepted,
        tau=(1 + accepted / drafts) if drafts else None,
        tau_per_position=[sum(r.tau_per_position[i] * r.num_drafts for r in runs if len(r.tau_per_position) > i)
                          / drafts for i in range(width)] if drafts else [],
        request_spec=[q for r in runs for q in r.request_spec])


def replay_once(target: str | Path, spec: dict | None, prompts: list[list[int]], opts: dict) -> dict:
    """One fresh engine, one warm-up request, one timed replay of ``prompts``; the body of
    :func:`replay_in_fresh_process`. ``opts``: dtype, max_model_len, seed, max_num_seqs,
    temperature, max_tokens and optionally tensor_parallel_size, env (variables set first), runner
    (``"v1"``/``"v2"``: how the calling process was set up, see :func:`replay_in_fresh_process`),
    engine (more ``LLM`` keyword arguments, e.g. CUDA-graph settings), k (draft tokens per round, for
    the V2 draft timer) and levels.

    ``levels``: ``[(label, batch, prompt indices), ...]``: the one engine replays each level's prompts
    in waves of ``batch`` requests submitted at once (batch sizes measured without an engine per
    size); the result then holds ``levels: {label: {summary, outputs, draft_rounds, request_spec}}``
    instead of those four keys."""
    os.environ.update(opts.get("env") or {})
    from vllm_dlite.vllm.plugin import register
    from lab.harness.runners import runner_of

    register()
    extra = dict(opts.get("engine") or {})
    if opts.get("tensor_parallel_size", 1) > 1:
        extra["tensor_parallel_size"] = opts["tensor_parallel_size"]
    llm = build_llm(target, spec, dtype=opts["dtype"], max_model_len=opts["max_model_len"],
                    seed=opts["seed"], max_num_seqs=opts["max_num_seqs"], **extra)
    try:
        runner = runner_of(llm)
        run_replay(llm, "warm-up", prompts[:1], max_tokens=4, temperature=opts["temperature"])
        levels = opts.get("levels") or [(None, None, range(len(prompts)))]
        by_level = {}
        for label, batch, indices in levels:
            chosen = [prompts[i] for i in indices]
            step = batch or len(chosen)
            # records nothing when the drafter runs in worker processes (TP > 1)
            with draft_timer(llm, runner, opts.get("k", 7)) as timer:
                r = merge_runs("replay", [run_replay(llm, "replay", chosen[i:i + step], max_tokens=opts["max_tokens"],
                                                     temperature=opts["temperature"], seed=opts["seed"])
                                          for i in range(0, len(chosen), step)])
            by_level[label] = dict(summary=r.summary(), outputs=r.outputs, draft_rounds=timer.records,
                                   request_spec=r.request_spec)
    finally:
        shutdown(llm)
    if opts.get("levels"):
        return dict(levels=by_level, runner=runner)
    return dict(**by_level[None], runner=runner)


def replay_in_fresh_process(target: str | Path, spec: dict | None, prompts: list[list[int]], opts: dict) -> dict:
    """:func:`replay_once` in a fresh process set up for ``opts["runner"]`` (``"v1"``, the default, or
    ``"v2"``: :mod:`lab.harness.runners`). Returns ``{summary, outputs, draft_rounds, request_spec,
    runner}`` (``runner``: the model runner the engine really used)."""
    from lab.harness.runners import call_with_runner

    return call_with_runner(opts.get("runner", "v1"), "lab.harness.replay:replay_once", str(target), spec,
                            prompts, opts)
