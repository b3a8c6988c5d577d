#!/usr/bin/env python3
"""Whole agentic sessions through ``vllm serve``, turn after turn, one server per speculative method.

    .venv/bin/python benchmarks/session_replay.py --out runs/session-replay \\
        --methods none,ngram,suffix,eagle3,dflash,dlite --concurrency 1,4,8

Contract:

* **Sessions**: the first ``--max-sessions`` sessions of ``--workload`` (docs/design.md §6), each
  replayed turn after turn: every assistant message (the first ``--max-turns`` of them) is one
  streamed ``/v1/chat/completions`` request whose ``messages`` are the session's RECORDED history
  before it (earlier assistant replies are the workload's, not the model's), with the session's
  ``tools``; greedy (temperature 0), ``max_tokens`` = ``--max-tokens``, ``return_token_ids`` on and
  ``logprobs`` off. The history is therefore the same for every method, and each turn's reply is
  compared token for token with ``none``'s (same concurrency): ``identical_to_none`` and
  ``mismatches`` (session, turn, first differing token). A session stops before its first turn
  whose prompt (tokenised here with the target's chat template) does not fit the target's context.
* **Servers**: one ``vllm serve`` per method (``lab.harness.server.VLLMServer``) with the
  README's flags (``--enable-auto-tool-choice --tool-call-parser hermes``) plus
  ``--enable-prefix-caching``, ``--enable-prompt-tokens-details``, ``--max-num-seqs`` = the largest
  concurrency, max model len = the target's context, the speculative config of
  ``vllm_dlite.vllm.engine.speculative_config`` and, with speculation, ``--per-request-spec-decode-metrics
  summary``; ``--enforce-eager`` skips vLLM's model compilation (a faster start-up, the same
  tokens) and ``--parallel-methods`` replays every method at once, each on its own server (same
  tokens and counters, timings not comparable); the test suite's smoke run uses both. One warm-up
  turn, then for each ``--concurrency`` level the prefix cache is emptied (``POST
  /reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``) and ``c`` workers replay the sessions (each
  worker takes the next session and plays its turns in order).
* **Per turn** (JSON): ``prompt_tokens`` and ``cached_tokens`` (the server's usage), TTFT (request
  sent -> first streamed token), TPOT ((last token - first token) / (tokens - 1)), output tok/s
  (tokens / request time), the request's own spec-decode record (vLLM's per-request histogram:
  drafts = verify steps with a draft, draft tokens, accepted, tau) and, at concurrency 1 only, the
  ``/metrics`` deltas over the turn (``vllm:prefix_cache_hits``/``_queries`` -> hit rate,
  ``vllm:spec_decode_num_drafts``/``_num_draft_tokens``/``_num_accepted_tokens``). At higher
  concurrency the ``/metrics`` deltas cover the whole level (requests overlap). ``after`` names the
  message that precedes the turn (``tool``: the draft work after a new tool result).
  ``ttft_over_none_ms`` (concurrency 1): this method's TTFT minus ``none``'s on the same turn, the
  only outside view of the draft work a new tool result costs (e.g. EAGLE-3/DFlash draft prefill).
  Draft time in ms is NOT reported: the server exposes no draft-time counter and from outside a
  draft round cannot be told apart from the target's verification (``benchmarks/ab.py`` times it
  in-process).
* **Per level**: turns, sessions, wall time, session wall time (first request sent -> last reply
  received, mean and max; at concurrency 1 it includes the harness's /metrics reads between turns,
  so ``session_requests_s_mean``, the sum of a session's request times, is also given), medians of
  TTFT / TPOT, output tok/s (all tokens / wall time), tau, prefix-cache hit rate, drafts and draft
  tokens per turn.
* ``--repeats N``: N passes over all methods, one after the other (methods interleaved in time),
  each method on a fresh server every pass (``repeats.combine_passes``): output tok/s, median TTFT,
  median TPOT, wall and mean session wall of each level are the medians over the passes, with every
  pass's values in ``summary["repeats"]`` and ``median (min-max)`` in ``results.md``; tau, counters
  and per-turn records are the first pass's; every pass's replies are compared with ``none``'s of
  the same pass.
* A method that cannot run here (no drafter checkpoint, missing package, server start failure) is
  reported with the reason, never dropped.

Writes ``OUT/results.json``, ``OUT/outputs.json`` (token ids per turn), ``OUT/results.md``, server
logs and, with matplotlib, ``OUT/ttft_vs_prompt_tokens.png`` and ``OUT/tpot_vs_prompt_tokens.png``.
Exits 1 when a method's replies differ from ``none``'s or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import traceback
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from repeats import combine_passes, spread  # noqa: E402  (beside this script)
from lab.harness.runners import default_runner  # noqa: E402

METRIC_NAMES = {
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "requests_finished": "vllm:request_success_total",
}
REPEATED_KEYS = ("output_tokens_per_s", "ttft_ms_median", "tpot_ms_median", "wall_s", "session_wall_s_mean")
DRAFT_MS_NOTE = ("draft time is not measured: vLLM's /metrics has no draft-time counter, and from outside the "
                 "server a draft round cannot be separated from the target's verification; ttft_over_none_ms "
                 "(concurrency 1) is the outside view of the extra work before the first token, and "
                 "benchmarks/ab.py times draft rounds in-process")


def default_drafter(method: str) -> Path:
    return REPO / "models" / f"{method}-qwen3-tiny-stdlib"


# ----------------------------------------------------------------------------- pure functions
@dataclass(frozen=True)
class Turn:
    session_id: str
    turn: int            # index of the assistant message within the session
    index: int           # 0-based position among the session's replayed turns
    after: str           # role of the message before this turn ("tool": a new tool result)
    messages: list       # the recorded history before the assistant message
    tools: list | None
    prompt_tokens: int | None = None  # tokenised here (the server's count is in the results)


def session_turns(session: dict, max_turns: int | None = None, count_tokens=None,
                  max_prompt_tokens: int | None = None) -> list[Turn]:
    """The replayed turns of one session: one per assistant message, its history the recorded
    messages before it (so every method sees the same history). ``count_tokens(messages, tools)``
    gives a prompt's length; with ``max_prompt_tokens`` the session stops before the first turn
    longer than that (later turns only get longer)."""
    tools = session.get("tools") or None
    out: list[Turn] = []
    for i, msg in enumerate(session["messages"]):
        if msg["role"] != "assistant" or i == 0:
            continue
        if max_turns is not None and len(out) >= max_turns:
            break
        history = session["messages"][:i]
        n = count_tokens(history, tools) if count_tokens else None
        if max_prompt_tokens is not None and n is not None and n > max_prompt_tokens:
            break
        out.append(Turn(session["id"], i, len(out), history[-1]["role"], history, tools, n))
    return out


def chat_body(turn: Turn, model: str, max_tokens: int) -> dict:
    """The streamed, greedy chat request of one turn (token ids back, no logprobs)."""
    body = dict(model=model, messages=turn.messages, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, return_token_ids=True, logprobs=False)
    if turn.tools:
        body["tools"] = turn.tools
    return body


def metric_delta(before: dict, after: dict) -> dict:
    """``METRIC_NAMES`` counters: after - before (``VLLMServer.metrics()`` dicts), with the
    prefix-cache hit rate (None when nothing was queried)."""
    d = {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in METRIC_NAMES.items()}
    d["prefix_cache_hit_rate"] = d["prefix_cache_hits"] / d["prefix_cache_queries"] if d["prefix_cache_queries"] else None
    return d


def spec_record(metrics: dict | None) -> dict:
    """A request's spec-decode figures from the ``metrics.speculative_decoding`` of its final
    chunk (vLLM's per-request histogram: ``acceptance_histogram[j]`` = verify steps with j
    accepted draft tokens); zeros when the server ran without speculation."""
    sd = (metrics or {}).get("speculative_decoding") or {}
    hist = list(sd.get("acceptance_histogram") or [])
    drafts = sum(hist)
    accepted = sum(j * c for j, c in enumerate(hist))
    return dict(drafts=drafts, draft_tokens=int(sd.get("num_draft_tokens") or 0), accepted=accepted,
                tau=1 + accepted / drafts if drafts else None, histogram=hist)


def stream_timings(t_sent: float, token_times: list[tuple[float, int]], t_done: float) -> dict:
    """TTFT, TPOT and output tok/s of one streamed request from the arrival time and token count
    of every chunk that carried tokens (a speculative step can deliver several tokens at once)."""
    n = sum(k for _, k in token_times)
    if not token_times:
        return dict(ttft_ms=None, tpot_ms=None, output_tokens_per_s=0.0, e2e_ms=1000 * (t_done - t_sent))
    first, last = token_times[0][0], token_times[-1][0]
    return dict(ttft_ms=1000 * (first - t_sent), tpot_ms=1000 * (last - first) / (n - 1) if n > 1 else None,
                output_tokens_per_s=n / (t_done - t_sent) if t_done > t_sent else 0.0,
                e2e_ms=1000 * (t_done - t_sent))


def compare_outputs(base: dict, other: dict) -> list[dict]:
    """Turns (``"session/turn"`` keys -> token ids) whose reply differs from ``base``'s, with the
    first differing token; a turn missing on either side counts as a mismatch."""
    out = []
    for key in sorted(set(base) | set(other)):
        a, b = base.get(key), other.get(key)
        if a == b:
            continue
        if a is None or b is None:
            out.append(dict(turn=key, first_diff=None, reason="missing in " + ("none" if a is None else "method")))
            continue
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append(dict(turn=key, first_diff=i, none_tokens=len(a), tokens=len(b)))
    return out


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize_level(turns: list[dict], wall_s: float, delta: dict, sessions: dict) -> dict:
    """Figures of one concurrency level from its per-turn records and the level's /metrics delta."""
    ok = [t for t in turns if t["status"] == 200 and not t.get("error")]
    tokens = sum(t["completion_tokens"] for t in ok)
    drafts = sum(t["spec"]["drafts"] for t in ok)
    accepted = sum(t["spec"]["accepted"] for t in ok)
    walls = [s["wall_s"] for s in sessions.values()]
    return dict(
        turns=len(turns), failed_turns=len(turns) - len(ok), sessions=len(sessions), wall_s=wall_s,
        session_wall_s_mean=sum(walls) / len(walls) if walls else None, session_wall_s_max=max(walls, default=None),
        session_requests_s_mean=(sum(s.get("requests_s", 0.0) for s in sessions.values()) / len(sessions)
                                 if sessions else None),
        ttft_ms_median=median(t["ttft_ms"] for t in ok), tpot_ms_median=median(t["tpot_ms"] for t in ok),
        output_tokens=tokens, output_tokens_per_s=tokens / wall_s if wall_s else 0.0,
        tau=1 + accepted / drafts if drafts else None, drafts=drafts,
        draft_tokens=sum(t["spec"]["draft_tokens"] for t in ok), accepted=accepted,
        drafts_per_turn=drafts / len(ok) if ok else None,
        draft_tokens_per_turn=sum(t["spec"]["draft_tokens"] for t in ok) / len(ok) if ok else None,
        prefix_cache_hit_rate=delta["prefix_cache_hit_rate"],
        cached_tokens_share=(sum(t["cached_tokens"] or 0 for t in ok) / sum(t["prompt_tokens"] for t in ok)
                             if ok and sum(t["prompt_tokens"] for t in ok) else None),
        metrics_delta=delta,
    )


# ----------------------------------------------------------------------------- talking to the server
async def stream_turn(http, url: str, body: dict) -> dict:
    """One streamed chat completion: token ids, chunk times, usage and per-request metrics."""
    import aiohttp

    out = dict(status=None, token_ids=[], finish_reason=None, usage=None, metrics=None, error=None)
    token_times: list[tuple[float, int]] = []
    t_sent = time.perf_counter()
    try:
        async with http.post(url, json=body) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                out["error"] = (await resp.text())[:300]
            else:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    got = 0
                    for choice in chunk.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        out["token_ids"].extend(ids)
                        got += len(ids)
                        out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                    if got:
                        token_times.append((time.perf_counter(), got))
                    if chunk.get("usage"):
                        out["usage"] = chunk["usage"]
                    if chunk.get("metrics"):
                        out["metrics"] = chunk["metrics"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out.update(stream_timings(t_sent, token_times, time.perf_counter()), t_sent=t_sent)
    return out


async def get_metrics(http, base_url: str) -> dict:
    """``/metrics`` summed over label sets (``lab.harness.server.parse_metrics``)."""
    from lab.harness.server import parse_metrics

    async with http.get(base_url + "/metrics") as resp:
        return parse_metrics(await resp.text())


async def settled_metrics(http, base_url: str, finished: float, timeout_s: float = 30) -> dict:
    """``/metrics`` once the server has counted ``finished`` finished requests: the stats of a
    request's last step are published after its last chunk may have reached the client."""
    deadline = time.time() + timeout_s
    while True:
        m = await get_metrics(http, base_url)
        if m.get(METRIC_NAMES["requests_finished"], 0.0) >= finished or time.time() > deadline:
            return m
        await asyncio.sleep(0.05)


def turn_record(turn: Turn, res: dict) -> dict:
    usage = res["usage"] or {}
    details = usage.get("prompt_tokens_details") or {}
    rec = dict(session=turn.session_id, turn=turn.turn, index=turn.index, after=turn.after,
               prompt_tokens=usage.get("prompt_tokens", turn.prompt_tokens),
               cached_tokens=details.get("cached_tokens"),
               completion_tokens=usage.get("completion_tokens", len(res["token_ids"])),
               token_ids_complete=usage.get("completion_tokens") == len(res["token_ids"]),
               status=res["status"], error=res["error"], finish_reason=res["finish_reason"],
               ttft_ms=res["ttft_ms"], tpot_ms=res["tpot_ms"], output_tokens_per_s=res["output_tokens_per_s"],
               e2e_ms=res["e2e_ms"], spec=spec_record(res["metrics"]))
    return rec


async def run_level(base_url: str, model: str, sessions: list[list[Turn]], concurrency: int, max_tokens: int,
                    timeout_s: float) -> dict:
    """Replay ``sessions`` with ``concurrency`` workers; per-turn /metrics deltas at concurrency 1."""
    import aiohttp

    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0))
    url = base_url + "/v1/chat/completions"
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)
    turns: list[dict] = []
    outputs: dict[str, list[int]] = {}
    session_stats: dict[str, dict] = {}
    per_turn_metrics = concurrency == 1

    async def worker() -> None:
        while not queue.empty():
            session = queue.get_nowait()
            t0 = time.perf_counter()
            for turn in session:
                before = await get_metrics(http, base_url) if per_turn_metrics else None
                res = await stream_turn(http, url, chat_body(turn, model, max_tokens))
                rec = turn_record(turn, res)
                if per_turn_metrics:
                    after = await settled_metrics(http, base_url,
                                                  before.get(METRIC_NAMES["requests_finished"], 0.0) + 1)
                    rec["metrics_delta"] = metric_delta(before, after)
                turns.append(rec)
                outputs[f"{turn.session_id}/{turn.turn}"] = res["token_ids"]
                if rec["error"]:
                    print(f"    {turn.session_id} turn {turn.turn}: {rec['status']} {rec['error']}", flush=True)
            session_stats[session[0].session_id] = dict(
                turns=len(session), wall_s=time.perf_counter() - t0,
                requests_s=sum(t["e2e_ms"] for t in turns if t["session"] == session[0].session_id) / 1000)

    try:
        start = await get_metrics(http, base_url)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(sessions)))))
        wall = time.perf_counter() - t0
        end = await settled_metrics(http, base_url, start.get(METRIC_NAMES["requests_finished"], 0.0) + len(turns))
    finally:
        await http.close()
    turns.sort(key=lambda t: (t["session"], t["turn"]))
    summary = summarize_level(turns, wall, metric_delta(start, end), session_stats)
    summary["sessions_at_once"] = min(concurrency, len(sessions))
    return dict(summary=summary, turns=turns, sessions=session_stats, outputs=outputs)


def post(url: str, timeout_s: float = 60) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.status


# ----------------------------------------------------------------------------- one method
def server_flags(args, spec: dict | None) -> list[str]:
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
             "--max-num-seqs", str(max(args.concurrency)), "--enable-prefix-caching",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prompt-tokens-details"]
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if spec is not None:
        flags += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    return flags


def run_method(args, method: str, sessions: list[list[Turn]]) -> dict:
    from vllm_dlite.vllm.engine import MethodUnavailable, cpu_env, speculative_config
    from lab.harness.server import ServerStartError, VLLMServer

    try:
        spec = speculative_config(method, args.k, getattr(args, method, None))
    except MethodUnavailable as exc:
        print(f"[{method}] unavailable: {exc}", flush=True)
        return {"status": "unavailable", "reason": str(exc)}
    from lab.harness.runners import runner_env, runner_from_log

    env = {**cpu_env(4, threads=1, environ=os.environ), **runner_env(args.runner),
           "VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache between concurrency levels
    levels, outputs = {}, {}
    t_start = time.time()
    try:
        with VLLMServer(args.target, *server_flags(args, spec), env=env, timeout_s=args.server_timeout_s,
                        log_path=args.out / f"server-{method}.log") as server:
            startup_s = time.time() - t_start
            used = runner_from_log(server.log_path.read_text(errors="replace"))
            if used != args.runner:
                raise RuntimeError(f"--runner {args.runner}: the server used Model Runner {used}")
            print(f"[{method}] server up in {startup_s:.0f} s (Model Runner {used})", flush=True)
            warm = sessions[0][:1]
            asyncio.run(run_level(server.base_url, args.target, [warm], 1, 4, args.timeout_s))
            for c in args.concurrency:
                post(server.base_url + "/reset_prefix_cache")
                res = asyncio.run(run_level(server.base_url, args.target, sessions, c, args.max_tokens,
                                            args.timeout_s))
                s = res["summary"]
                print(f"[{method}] concurrency {c}: {s['turns']} turns, tau "
                      f"{'-' if s['tau'] is None else round(s['tau'], 2)}, TTFT {s['ttft_ms_median']:.0f} ms, "
                      f"TPOT {fmt(s['tpot_ms_median'])} ms, {s['output_tokens_per_s']:.1f} tok/s, prefix hit "
                      f"{fmt(s['prefix_cache_hit_rate'], '.2f')}, {s['wall_s']:.0f} s", flush=True)
                outputs[c] = res.pop("outputs")
                levels[str(c)] = res
    except ServerStartError as exc:
        tail = [ln for ln in exc.log_tail.splitlines() if ln.strip()][-3:]
        print(f"[{method}] server failed: {exc}", flush=True)
        return {"status": "failed", "reason": f"vllm serve did not start: {' | '.join(tail)[-600:]}"}
    except Exception as exc:  # noqa: BLE001 - reported in the results with the levels measured so far
        traceback.print_exc()
        print(f"[{method}] failed: {exc!r}", flush=True)
        return {"status": "failed", "reason": f"{exc!r}"[:600], "by_concurrency_measured": levels}
    return {"status": "ok", "server_startup_s": startup_s, "speculative_config": spec,
            "by_concurrency": levels, "_outputs": outputs}


def combine_method_passes(runs: list[dict]) -> dict:
    """One method's record from its ``--repeats`` passes: each level's ``REPEATED_KEYS`` the median
    over the passes (``repeats.combine_passes``), ``_outputs`` every pass's."""
    return combine_passes(runs, REPEATED_KEYS, cell=lambda run, c: run["by_concurrency"][c]["summary"])


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


# ----------------------------------------------------------------------------- reports
def add_comparisons(results: dict, outputs: dict) -> None:
    """``identical_to_none``/``mismatches`` per level (``outputs[m]``: every pass's, each compared
    with ``none``'s of the same pass, since both ran every pass: a failed pass fails the method; a
    mismatch names its pass), and ``ttft_over_none_ms`` per turn
    at c=1 (first pass)."""
    base = outputs.get("none")
    none_turns = {}
    if results.get("none", {}).get("status") == "ok" and "1" in results["none"]["by_concurrency"]:
        none_turns = {(t["session"], t["turn"]): t for t in results["none"]["by_concurrency"]["1"]["turns"]}
    for m, r in results.items():
        if r["status"] != "ok":
            continue
        for c, level in r["by_concurrency"].items():
            if m != "none" and base is not None and int(c) in base[0]:
                mism = [{**x, "pass": i} for i, o in enumerate(outputs[m])
                        for x in compare_outputs(base[i][int(c)], o[int(c)])]
                level["summary"]["identical_to_none"] = not mism
                level["summary"]["mismatches"] = mism
            if c == "1" and none_turns and m != "none":
                for t in level["turns"]:
                    ref = none_turns.get((t["session"], t["turn"]))
                    t["ttft_over_none_ms"] = (t["ttft_ms"] - ref["ttft_ms"]
                                              if ref and ref["ttft_ms"] is not None and t["ttft_ms"] is not None
                                              else None)
                level["summary"]["ttft_over_none_ms_median"] = median(t["ttft_over_none_ms"] for t in level["turns"])


def write_markdown(path: Path, settings: dict, results: dict) -> None:
    s = settings
    lines = [f"# Session replay: {Path(s['workload']).name} through vllm serve", "",
             f"target `{s['target']}`, K={s['k']}, greedy, max {s['max_tokens']} new tokens per turn, "
             f"{s['sessions']} sessions x up to {s['max_turns'] or 'all'} turns ({s['turns']} turns, "
             f"{s['prompt_tokens_min']}-{s['prompt_tokens_max']} prompt tokens), recorded history, "
             f"dtype {s['dtype']}, max model len {s['max_model_len']}, prefix caching on"
             f"{', eager (no compilation)' if s.get('enforce_eager') else ''}"
             f"{', methods replayed at once (timings not comparable)' if s.get('parallel_methods') else ''}"
             f", device {s['device']}"
             + (f", {s['repeats']} passes (timings: median (min-max), methods interleaved)"
                if s.get("repeats", 1) > 1 else "") + ".", "",
             "| method | sessions at once | tau | TTFT ms (median) | TPOT ms (median) | output tok/s | "
             "prefix-cache hit rate | drafts / draft tokens per turn | TTFT over none ms (median) | "
             "session wall s (mean / max) | identical to none |",
             "|" + " --- |" * 11]
    for m, r in results.items():
        if r["status"] != "ok":
            lines.append(f"| {m} | {r['status']}: {r['reason']} |" + " |" * 9)
            continue
        for c, level in r["by_concurrency"].items():
            x = level["summary"]
            same = x.get("identical_to_none", "-")
            if same is False:
                same = f"False ({len(x['mismatches'])} turns)"
            lines.append(
                f"| {m} | {c} | {fmt(x['tau'], '.2f')} | {fmt(x['ttft_ms_median'])} | "
                f"{spread(x, 'tpot_ms_median')} | "
                f"{spread(x, 'output_tokens_per_s')} | {fmt(x['prefix_cache_hit_rate'], '.3f')} | "
                f"{fmt(x['drafts_per_turn'])} / {fmt(x['draft_tokens_per_turn'])} | "
                f"{fmt(x.get('ttft_over_none_ms_median'))} | "
                f"{fmt(x['session_wall_s_mean'])} / {fmt(x['session_wall_s_max'])} | {same} |")
    c0 = str(min(s["concurrency"]))
    first = next((r["by_concurrency"][c0]["turns"] for r in results.values() if r["status"] == "ok"), [])
    sid = first[0]["session"] if first else None
    if sid:
        lines += ["", f"Per turn, session `{sid}`, {c0} session(s) at once (`after`: the message before the turn; "
                  "prefix hit from /metrics deltas when 1 session at once):", "",
                  "| method | turn | after | prompt tokens | cached | TTFT ms | TPOT ms | drafts | draft tokens | "
                  "accepted | prefix hit |", "|" + " --- |" * 11]
        for m, r in results.items():
            if r["status"] != "ok":
                continue
            for t in r["by_concurrency"][c0]["turns"]:
                if t["session"] != sid:
                    continue
                hit = (t.get("metrics_delta") or {}).get("prefix_cache_hit_rate")
                lines.append(f"| {m} | {t['turn']} | {t['after']} | {t['prompt_tokens']} | {t['cached_tokens']} | "
                             f"{fmt(t['ttft_ms'])} | {fmt(t['tpot_ms'])} | {t['spec']['drafts']} | "
                             f"{t['spec']['draft_tokens']} | {t['spec']['accepted']} | {fmt(hit, '.3f')} |")
    lines += ["", f"Draft time: {DRAFT_MS_NOTE}.", "", f"Command: `{s['command']}`", ""]
    path.write_text("\n".join(lines))


def binned_medians(points: list[tuple[float, float]], bins: int = 8) -> list[tuple[float, float]]:
    """(median x, median y) per log-spaced prompt-length bin, for the line over the scatter."""
    lo, hi = min(x for x, _ in points), max(x for x, _ in points)
    if hi <= lo:
        return [(lo, statistics.median(y for _, y in points))]
    edges = [lo * (hi / lo) ** (i / bins) for i in range(bins + 1)]
    out = []
    for a, b in zip(edges, edges[1:]):
        sel = [(x, y) for x, y in points if a <= x < b or (b == hi and x == hi)]
        if sel:
            out.append((statistics.median(x for x, _ in sel), statistics.median(y for _, y in sel)))
    return out


def write_plots(out: Path, results: dict, concurrency: list[int]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["plots skipped: matplotlib is not installed (pip install -e .[bench])"]
    ok = {m: r for m, r in results.items() if r["status"] == "ok"}
    made = []
    for key, label, name in (("ttft_ms", "TTFT (ms)", "ttft_vs_prompt_tokens.png"),
                             ("tpot_ms", "TPOT (ms)", "tpot_vs_prompt_tokens.png")):
        fig, axes = plt.subplots(1, len(concurrency), figsize=(5 * len(concurrency), 4), squeeze=False)
        for ax, c in zip(axes[0], concurrency):
            for i, (m, r) in enumerate(ok.items()):
                pts = sorted((t["prompt_tokens"], t[key]) for t in r["by_concurrency"][str(c)]["turns"]
                             if t[key] is not None)
                if not pts:
                    continue
                ax.scatter(*zip(*pts), s=10, alpha=0.4, color=f"C{i}")
                ax.plot(*zip(*binned_medians(pts)), marker="o", lw=1.2, color=f"C{i}", label=m)
            ax.set(xlabel="prompt tokens", ylabel=label, xscale="log",
                   title=f"{label.split()[0]}, {c} session(s) at once (dots: turns; line: median per length bin)")
            ax.title.set_fontsize(8)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.savefig(out / name, dpi=120, bbox_inches="tight")
        made.append(name)
    plt.close("all")
    return made


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"))
    ap.add_argument("--methods", default="none,ngram,suffix,eagle3,dflash,dlite")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    for m in ("dlite", "eagle3", "dflash"):
        ap.add_argument(f"--{m}", default=str(default_drafter(m)), help=f"{m} drafter checkpoint")
    ap.add_argument("-k", "--k", type=int, default=None,
                    help="speculative tokens per round (default: the --dlite checkpoint's K)")
    ap.add_argument("--concurrency", default="1,4,8", help="sessions replayed at once, comma-separated levels")
    ap.add_argument("--max-sessions", type=int, default=0, help="first N sessions (0: all)")
    ap.add_argument("--max-turns", type=int, default=0, help="first N assistant turns per session (0: all)")
    ap.add_argument("--max-tokens", type=int, default=64, help="new tokens per turn")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runner", choices=("v1", "v2"), default=default_runner(),
                    help="vLLM model runner; v2 on CPU runs through Triton's interpreter (lab.harness.runners): slow")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="servers without vLLM's model compilation (faster start-up; the suite's smoke run)")
    ap.add_argument("--parallel-methods", action="store_true",
                    help="replay all methods at once, each on its own server (a smoke run on a CPU with a core per "
                         "server: the same tokens and counters, but timings that are not comparable)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over all methods (interleaved), each on fresh servers; timings are the medians")
    ap.add_argument("--timeout-s", type=float, default=3600, help="per request")
    ap.add_argument("--server-timeout-s", type=float, default=900, help="server start-up")
    args = ap.parse_args(argv)
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, args.dlite)  # default: the drafter's own K
    from vllm_dlite.vllm.engine import METHODS

    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers like 1,4,8, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency: every level must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        ap.error(f"--methods: unknown {unknown or 'empty list'}; choose from {','.join(METHODS)}")
    if min(args.max_sessions, args.max_turns) < 0 or args.max_tokens < 1:
        ap.error("--max-sessions and --max-turns must be >= 0, --max-tokens >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if not Path(args.workload).is_file():
        ap.error(f"--workload: {args.workload} does not exist (a sessions JSONL, docs/design.md §6)")

    import torch
    from transformers import AutoConfig, AutoTokenizer

    from vllm_dlite.train.workloads.replay import chat_token_ids
    from vllm_dlite.train.workloads.schema import read_sessions

    cfg = AutoConfig.from_pretrained(args.target)
    args.max_model_len = int(getattr(getattr(cfg, "text_config", None) or cfg, "max_position_embeddings"))
    # vLLM may render the history a few tokens differently from HF (tool-call arguments): margin
    max_prompt = args.max_model_len - args.max_tokens - args.k - 64
    tok = AutoTokenizer.from_pretrained(args.target)
    count = lambda messages, tools: len(chat_token_ids(tok, messages, tools, add_generation_prompt=True))  # noqa: E731
    raw = list(read_sessions(args.workload))
    if args.max_sessions:
        raw = raw[: args.max_sessions]
    sessions = [t for t in (session_turns(s, args.max_turns or None, count, max_prompt) for s in raw) if t]
    if not sessions:
        raise SystemExit(f"{args.workload}: no session has a turn that fits in {max_prompt} prompt tokens")
    lengths = [t.prompt_tokens for s in sessions for t in s]
    args.out.mkdir(parents=True, exist_ok=True)
    settings = dict(
        workload=args.workload, target=args.target, k=args.k, temperature=0.0, max_tokens=args.max_tokens,
        dtype=args.dtype, seed=args.seed, runner=args.runner, enforce_eager=args.enforce_eager,
        parallel_methods=args.parallel_methods, concurrency=args.concurrency, repeats=args.repeats,
        sessions=len(sessions), max_turns=args.max_turns or None, turns=len(lengths), prompt_tokens_min=min(lengths),
        prompt_tokens_max=max(lengths), max_model_len=args.max_model_len,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)",
        drafters={m: getattr(args, m) for m in ("dlite", "eagle3", "dflash")
                  if any(x.split("-")[0] == m for x in methods)},
        draft_ms=DRAFT_MS_NOTE,
        command="python benchmarks/session_replay.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    print(json.dumps(settings), flush=True)
    t0 = time.time()
    passes = []
    for _ in range(args.repeats):  # methods interleaved: pass after pass
        if args.parallel_methods:  # every method's server at once: a smoke run, timings not comparable
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(methods)) as pool:
                passes.append(dict(zip(methods, pool.map(lambda m: run_method(args, m, sessions), methods))))
        else:
            passes.append({m: run_method(args, m, sessions) for m in methods})
    results = {m: combine_method_passes([p[m] for p in passes]) for m in methods}
    outputs = {m: r.pop("_outputs") for m, r in results.items() if "_outputs" in r}
    add_comparisons(results, outputs)
    settings["wall_s"] = round(time.time() - t0, 1)
    (args.out / "results.json").write_text(json.dumps(dict(settings=settings, methods=results), indent=2) + "\n")
    (args.out / "outputs.json").write_text(json.dumps({m: o[0] for m, o in outputs.items()}) + "\n")  # first pass
    write_markdown(args.out / "results.md", settings, results)
    notes = write_plots(args.out, results, args.concurrency)
    print((args.out / "results.md").read_text())
    print("\n".join(notes))
    bad = [m for m, r in results.items() if r["status"] == "ok" and any(
        lv["summary"].get("identical_to_none") is False or lv["summary"]["failed_turns"]
        for lv in r["by_concurrency"].values())]
    if bad:
        print(f"error: {bad}: replies differ from none's or requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
