#!/usr/bin/env python3
"""Load and faults against the OpenAI-compatible server with DLite: nothing lost, nothing leaked.

    .venv/bin/python benchmarks/serve_load.py --out runs/serve-load          # shipped tiny models

Contract (loopback only; bounded by ``--requests``, ``--rounds`` and the timeouts):

1. **Requests**: ``--requests`` (64) chat completions with the agent's tools, taken from every
   assistant turn of the workload files (docs/design.md §6) and spread over prompt length up to
   the served context (``prompt + max_tokens <= --max-model-len``, the longest turn that fits is
   always in); greedy, streamed, ``return_token_ids`` on so outputs compare token for token.
2. **Reference**: a server WITHOUT speculation answers every request once (streamed, no abort).
3. **Load**: a server WITH DLite and a KV pool of ``--kv-blocks`` blocks of ``--block-size`` tokens
   (by default room for two max-length requests) that admits requests by
   their first prefill chunk (``--no-scheduler-reserve-full-isl``, chunks of
   ``--max-num-batched-tokens``), so vLLM over-commits and must preempt, gets all requests at
   once per round: a warm-up round, then ``--rounds`` rounds. In each round a seeded
   ``--abort-fraction`` of the streams is closed by the client after a random number of tokens. Checked per round: every
   completed stream equals the reference token for token, every aborted stream's tokens are a
   prefix of it, no 5xx, the server is alive, and once the round ends vLLM reports no running or
   waiting request and an empty KV cache (aborted requests freed). Resident memory of the server's
   whole process tree is sampled every second; growth = last round's end / warm-up's end - 1.
4. **Bad input**, sent to both servers: empty ``messages``, an invalid tool schema, a huge
   ``max_tokens``, a prompt over the context limit, a body that is not JSON. Each must get the
   same status and error type from the DLite server as from the plain one (vLLM's normal error), no
   5xx, and a good request afterwards must still be answered.
5. **Corrupted drafter checkpoints** (truncated ``model.safetensors``, a missing tensor, a wrong
   dtype, a wrong shape): ``vllm serve`` must exit non-zero and its log must name the file.

``--enforce-eager`` starts every server without vLLM's model compilation (same tokens, a faster
start-up) and ``--overlap-startup`` starts the DLite server and the corrupted-checkpoint start-ups
(5.) while the reference server (2.) starts and answers (CPU only; on one GPU they would compete for
memory); ``tests/test_serving_faults.py`` uses both. Neither changes what is checked.

Writes ``OUT/results.json`` (every figure) and ``OUT/results.md``; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lab.harness.faults import CHECKPOINT_FAULTS, damage_weights  # noqa: E402
from lab.harness.runners import default_runner, runner_env  # noqa: E402
from vllm_dlite.vllm.engine import cpu_env  # noqa: E402

BAD_INPUTS = ("empty_messages", "invalid_tool_schema", "huge_max_tokens", "prompt_over_context", "not_json")


# ----------------------------------------------------------------------------- requests
def build_requests(workloads: list[str], tokenizer, n: int, max_model_len: int, max_tokens: int) -> list[dict]:
    """``n`` chat requests spread evenly over prompt length; the longest one that fits is kept."""
    from vllm_dlite.train.workloads.replay import chat_token_ids
    from vllm_dlite.train.workloads.schema import read_sessions

    turns = []
    for path in workloads:
        for session in read_sessions(path):
            tools = session.get("tools") or None
            for i, m in enumerate(session["messages"]):
                if m["role"] != "assistant" or i == 0:
                    continue
                messages = session["messages"][:i]
                length = len(chat_token_ids(tokenizer, messages, tools, add_generation_prompt=True))
                if length + max_tokens <= max_model_len:
                    turns.append((length, messages, tools))
    if len(turns) < n:
        raise SystemExit(f"only {len(turns)} assistant turns fit in {max_model_len} tokens; need {n}")
    turns.sort(key=lambda t: t[0])
    picks = [turns[round(i * (len(turns) - 1) / (n - 1))] for i in range(n)] if n > 1 else [turns[-1]]
    out = []
    for length, messages, tools in picks:
        body = dict(messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
                    stream_options={"include_usage": True}, return_token_ids=True)
        if tools:
            body["tools"] = tools
        out.append(dict(prompt_tokens=length, body=body))
    return out


async def stream_chat(session, url: str, body: dict, model: str, abort_after: int | None) -> dict:
    """One streamed chat completion; after ``abort_after`` tokens the client closes the stream."""
    import aiohttp

    out = dict(status=None, token_ids=[], chunks=0, aborted=False, finish_reason=None, error=None)
    try:
        async with session.post(url, json={**body, "model": model}) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                out["error"] = (await resp.text())[:300]
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    out["token_ids"].extend(choice.get("token_ids") or [])
                    out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                out["chunks"] += 1
                if abort_after is not None and len(out["token_ids"]) >= abort_after and out["finish_reason"] is None:
                    out["aborted"] = True
                    resp.close()  # drops the connection: the server must abort the request
                    return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


async def run_round(base: str, model: str, requests: list[dict], aborts: dict[int, int], timeout_s: float) -> list[dict]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        url = base + "/v1/chat/completions"
        return await asyncio.gather(*(stream_chat(session, url, r["body"], model, aborts.get(i))
                                      for i, r in enumerate(requests)))


async def post_raw(base: str, data: bytes | str, timeout_s: float = 120) -> tuple[int, str]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(base + "/v1/chat/completions", data=data,
                                headers={"Content-Type": "application/json"}) as resp:
            return resp.status, (await resp.text())[:400]


def bad_inputs(model: str, max_model_len: int, good: dict) -> dict[str, bytes]:
    """The request-level bad inputs, as raw bodies."""
    base = {k: v for k, v in good.items() if k not in ("stream", "stream_options")}
    base["model"] = model
    over = dict(base, messages=[{"role": "user", "content": "list the files " * max_model_len}])
    bodies = {
        "empty_messages": dict(base, messages=[]),
        "invalid_tool_schema": dict(base, tools=[{"type": "function", "function": {"parameters": "not a schema"}}]),
        "huge_max_tokens": dict(base, max_tokens=10**9),
        "prompt_over_context": over,
    }
    raw = {name: json.dumps(body).encode() for name, body in bodies.items()}
    raw["not_json"] = b'{"model": "x", "messages": [ '
    return raw


def error_type(text: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return "?"
    err = data.get("error", data) if isinstance(data, dict) else {}
    return str(err.get("type", "?")) if isinstance(err, dict) else "?"


# ----------------------------------------------------------------------------- measurements
class RssSampler:
    """Samples the server tree's resident memory every ``period_s`` in a thread."""

    def __init__(self, server, period_s: float = 1.0):
        self.server, self.period_s, self.samples = server, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.time()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((round(time.time() - self.t0, 1), self.server.rss_bytes()))
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def wait_idle(server, timeout_s: float = 60) -> dict:
    """Poll ``/metrics`` until no request runs or waits; returns the gauges seen last."""
    deadline = time.time() + timeout_s
    while True:
        m = server.metrics()
        gauges = {k: m.get(f"vllm:{k}", float("nan")) for k in ("num_requests_running", "num_requests_waiting",
                                                                 "kv_cache_usage_perc")}
        if (gauges["num_requests_running"] == 0 and gauges["num_requests_waiting"] == 0) or time.time() > deadline:
            return gauges
        time.sleep(0.5)


def corrupt(src: Path, dst: Path, how: str) -> Path:
    """A copy of the drafter at ``dst`` whose weights file is damaged ``how``."""
    shutil.copytree(src, dst)
    damage_weights(dst / "model.safetensors", how)
    return dst / "model.safetensors"


def corrupt_startup(args, how: str, spec: dict, common: list[str], env: dict) -> dict:
    """``vllm serve`` with a copy of the drafter damaged ``how``: its exit code, whether its log
    names the damaged file (an error line), how long it took."""
    from lab.harness.server import ServerStartError, VLLMServer

    work = args.out / f"corrupt-{how}"
    shutil.rmtree(work, ignore_errors=True)
    f = corrupt(Path(args.drafter), work, how)
    flags = [*common, "--speculative-config", json.dumps({**spec, "model": str(work)})]
    t0 = time.time()
    try:
        with VLLMServer(args.target, *flags, env=env, timeout_s=300, log_path=args.out / f"corrupt-{how}.log"):
            rc, tail = 0, ""
    except ServerStartError as exc:
        rc, tail = exc.returncode, exc.log_tail
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [ln for ln in tail.splitlines() if str(f) in ln and ("Error" in ln or "error" in ln)]
    return dict(returncode=rc, wall_s=round(time.time() - t0, 1), names_file=bool(lines),
                error=lines[-1][-300:] if lines else None, file=str(f), log_tail=tail[-4000:])


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default=str(REPO / "models/qwen3-tiny-stdlib"))
    ap.add_argument("--drafter", default=str(REPO / "models/dlite-qwen3-tiny-stdlib"))
    ap.add_argument("--workload", nargs="+", default=[str(REPO / "benchmarks/workloads/heldout_agentic.jsonl"),
                                                      str(REPO / "benchmarks/workloads/heldout_code.jsonl")])
    ap.add_argument("-k", "--k", type=int, default=None, help="draft tokens per round (default: the --drafter's K)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds after the warm-up round")
    ap.add_argument("--abort-fraction", type=float, default=0.25)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--block-size", type=int, default=32,
                    help="KV block size of both servers (small blocks make decoding allocate often, so a small "
                         "pool preempts; vLLM's CPU backend needs a multiple of 32)")
    ap.add_argument("--kv-blocks", type=int, default=0,
                    help="KV pool of the DLite server in blocks (default: room for two max-length requests, "
                         "a small fraction of what the concurrent requests need)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512,
                    help="prefill chunk / step token budget of both servers (long prompts take several steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="every server without vLLM's model compilation (faster start-up; the test suite's run)")
    ap.add_argument("--overlap-startup", action="store_true",
                    help="start the DLite server and the corrupted-checkpoint start-ups while the reference server "
                         "starts and answers (CPU: each needs a core; on one GPU they would compete for memory)")
    ap.add_argument("--timeout-s", type=float, default=900, help="per round")
    ap.add_argument("--runner", choices=("v1", "v2"), default=default_runner(),
                    help="vLLM model runner of every server (default: V1 where vLLM has it); v2 on CPU runs "
                         "through Triton's interpreter (lab.harness.runners): slow")
    ap.add_argument("--corrupt", default=",".join(CHECKPOINT_FAULTS),
                    help=f"corrupted-checkpoint start-ups to try, comma-separated from {','.join(CHECKPOINT_FAULTS)} "
                         "('' for none)")
    args = ap.parse_args(argv)
    from vllm_dlite.config import resolve_k

    args.k = resolve_k(args.k, args.drafter)  # default: the drafter's own K
    if not 0 <= args.abort_fraction < 1:
        ap.error("--abort-fraction must be in [0, 1)")
    if args.requests < 1 or args.rounds < 1:
        ap.error("--requests and --rounds must be >= 1")
    corruptions = [c for c in args.corrupt.split(",") if c]
    if set(corruptions) - set(CHECKPOINT_FAULTS):
        ap.error(f"--corrupt: unknown {sorted(set(corruptions) - set(CHECKPOINT_FAULTS))}; choose from {CHECKPOINT_FAULTS}")

    from transformers import AutoTokenizer

    from lab.harness.server import VLLMServer

    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(args.target)
    requests = build_requests(args.workload, tok, args.requests, args.max_model_len, args.max_tokens)
    bs = args.block_size
    need_blocks = sum(-(-(r["prompt_tokens"] + args.max_tokens) // bs) for r in requests)
    kv_blocks = args.kv_blocks or 2 * -(-args.max_model_len // bs)
    spec = {"method": "dlite", "model": args.drafter, "num_speculative_tokens": args.k}
    common = ["--dtype", "float32", "--max-model-len", str(args.max_model_len), "--enable-auto-tool-choice",
              "--tool-call-parser", "hermes", "--max-num-seqs", str(args.requests), "--seed", str(args.seed),
              "--block-size", str(bs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.enforce_eager:
        common.append("--enforce-eager")
    env = {**cpu_env(2, threads=1), **runner_env(args.runner)}
    args.out.mkdir(parents=True, exist_ok=True)
    settings = dict(target=args.target, drafter=args.drafter, k=args.k, temperature=0.0, requests=len(requests),
                    prompt_tokens=[r["prompt_tokens"] for r in requests], max_tokens=args.max_tokens,
                    max_model_len=args.max_model_len, block_size=bs, kv_blocks=kv_blocks, kv_tokens=bs * kv_blocks,
                    kv_tokens_needed_at_once=bs * need_blocks, rounds=args.rounds, abort_fraction=args.abort_fraction,
                    seed=args.seed, enforce_eager=args.enforce_eager, overlap_startup=args.overlap_startup,
                    device="cpu", runner=args.runner,
                    command="python benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(json.dumps({k: v for k, v in settings.items() if k != "prompt_tokens"}), flush=True)
    results: dict = dict(settings=settings)
    failures: list[str] = []
    bad = bad_inputs(args.target, args.max_model_len, requests[0]["body"])

    # the DLite server of 3.: admits requests by their first prefill chunk, not their whole prompt, so
    # the small pool over-commits and vLLM must preempt running requests (with the default it would
    # only queue them). With --overlap-startup it and the corrupted-checkpoint start-ups of 5. start in
    # the background while the reference server starts and answers.
    dlite_flags = [*common, "--num-gpu-blocks-override", str(kv_blocks), "--no-scheduler-reserve-full-isl",
                   "--speculative-config", json.dumps(spec)]
    server = VLLMServer(args.target, *dlite_flags, env=env, log_path=args.out / "dlite.log")
    pool = ThreadPoolExecutor(1 + len(corruptions)) if args.overlap_startup else None
    started = pool.submit(server.start) if pool else None
    corrupt_runs = {how: pool.submit(corrupt_startup, args, how, spec, common, env)
                    for how in (corruptions if pool else ())}
    try:
        # 2. reference answers and error responses, no speculation
        print("[reference] server without speculation", flush=True)
        with VLLMServer(args.target, *common, env=env, log_path=args.out / "reference.log") as ref:
            t0 = time.time()
            reference = asyncio.run(run_round(ref.base_url, args.target, requests, {}, args.timeout_s))
            ref_errors = {name: asyncio.run(post_raw(ref.base_url, body)) for name, body in bad.items()}
            results["reference"] = dict(wall_s=round(time.time() - t0, 1),
                                        statuses=sorted({r["status"] for r in reference}),
                                        token_ids=[r["token_ids"] for r in reference])
        bad_ref = [i for i, r in enumerate(reference) if r["status"] != 200 or r["finish_reason"] is None]
        if bad_ref:
            failures.append(f"reference server failed requests {bad_ref}")

        # 3. load with aborts on the DLite server with a small KV pool
        print(f"[dlite] server with DLite, KV pool {kv_blocks} blocks", flush=True)
        rng = random.Random(args.seed)
        rounds = []
        if started is None:
            server.start()
        else:
            started.result()  # raises its ServerStartError
        with RssSampler(server) as rss:
            preempted = 0.0
            for rnd in range(args.rounds + 1):
                # abort after a random number of received tokens, early enough that the stream is
                # still open (the last chunk of a speculative step carries up to K + 1 tokens)
                n_abort = round(args.abort_fraction * len(requests))
                abortable = [i for i, ref_out in enumerate(reference) if len(ref_out["token_ids"]) > args.k + 2]
                aborts = {i: rng.randint(1, len(reference[i]["token_ids"]) - args.k - 2)
                          for i in rng.sample(abortable, min(n_abort, len(abortable)))}
                t0 = time.time()
                outs = asyncio.run(run_round(server.base_url, args.target, requests, aborts, args.timeout_s))
                wall = time.time() - t0
                gauges = wait_idle(server)
                total_preempted = server.metrics().get("vllm:num_preemptions_total", 0.0)
                r = dict(round="warm-up" if rnd == 0 else rnd, wall_s=round(wall, 1), sent=len(outs),
                         aborted=sum(o["aborted"] for o in outs),
                         completed=sum(o["status"] == 200 and o["finish_reason"] is not None for o in outs),
                         mismatches=0, prefix_mismatches=0, errors={}, rss_bytes_end=server.rss_bytes(),
                         alive=server.alive(), idle_gauges=gauges, preemptions=total_preempted - preempted,
                         outputs=[{k: o[k] for k in ("token_ids", "aborted", "status", "error", "finish_reason")}
                                  for o in outs])
                preempted = total_preempted
                for i, o in enumerate(outs):
                    want = reference[i]["token_ids"]
                    if o["error"] or o["status"] != 200:
                        kind = f"http_{o['status']}" if o["status"] else (o["error"] or "?").split(":")[0]
                        r["errors"][kind] = r["errors"].get(kind, 0) + 1
                    elif o["aborted"]:
                        r["prefix_mismatches"] += o["token_ids"] != want[: len(o["token_ids"])]
                    elif o["token_ids"] != want:
                        r["mismatches"] += 1
                print(f"[dlite] round {r['round']}: {r['completed']} completed, {r['aborted']} aborted, "
                      f"{r['mismatches']} mismatches, {r['prefix_mismatches']} prefix mismatches, "
                      f"{r['preemptions']:.0f} preemptions, errors "
                      f"{r['errors'] or 0}, {wall:.0f} s, RSS {r['rss_bytes_end'] / 2**20:.0f} MiB, idle {gauges}",
                      flush=True)
                rounds.append(r)
                if not r["alive"]:
                    failures.append(f"server died in round {r['round']}")
                    break
        metrics = server.metrics()
        dlite_errors = {name: asyncio.run(post_raw(server.base_url, body)) for name, body in bad.items()}
        after_bad = asyncio.run(run_round(server.base_url, args.target, requests[:1], {}, args.timeout_s))[0]
        alive_after_bad = server.alive()
    finally:
        if started is not None:
            started.exception()  # let a background start finish before stopping its server
        server.stop()
        if pool is not None:
            pool.shutdown(wait=True)
    warm = rounds[0]["rss_bytes_end"]
    growth = rounds[-1]["rss_bytes_end"] / warm - 1 if warm else float("nan")
    results["load"] = dict(
        rounds=rounds, rss_samples_mib=[(t, round(b / 2**20, 1)) for t, b in rss.samples],
        rss_growth_after_warmup=growth, preemptions=metrics.get("vllm:num_preemptions_total", 0),
        spec_decode={k: v for k, v in metrics.items() if k.startswith("vllm:spec_decode_num") and k.endswith("_total")},
        totals=dict(sent=sum(r["sent"] for r in rounds), completed=sum(r["completed"] for r in rounds),
                    aborted=sum(r["aborted"] for r in rounds), mismatches=sum(r["mismatches"] for r in rounds),
                    prefix_mismatches=sum(r["prefix_mismatches"] for r in rounds)))
    for r in rounds:
        if r["mismatches"] or r["prefix_mismatches"]:
            failures.append(f"round {r['round']}: {r['mismatches']} + {r['prefix_mismatches']} (prefix) mismatches")
        if any(k.startswith("http_5") or not k.startswith("http_") for k in r["errors"]):
            failures.append(f"round {r['round']}: errors {r['errors']}")
        g = r["idle_gauges"]
        if g["num_requests_running"] or g["num_requests_waiting"] or g["kv_cache_usage_perc"]:
            failures.append(f"round {r['round']}: not idle after the round {g}")
    if len(rounds) > 1 and growth >= 0.05:
        failures.append(f"resident memory grew {100 * growth:.1f}% after warm-up (limit 5%)")
    if not results["load"]["preemptions"]:
        failures.append("no preemption happened: lower --kv-blocks")

    # 4. bad input: the same error as without speculation, no 5xx, still serving
    results["bad_input"] = {}
    for name in bad:
        (rs, rt), (ds, dt) = ref_errors[name], dlite_errors[name]
        same = rs == ds and error_type(rt) == error_type(dt)
        results["bad_input"][name] = dict(reference_status=rs, dlite_status=ds, reference_type=error_type(rt),
                                          dlite_type=error_type(dt), same=same, dlite_body=dt[:200])
        if not same or ds >= 500:
            failures.append(f"bad input {name}: DLite server {ds} {error_type(dt)} vs reference {rs} {error_type(rt)}")
    ok_after = after_bad["status"] == 200 and after_bad["token_ids"] == reference[0]["token_ids"]
    results["bad_input"]["served_after"] = dict(alive=alive_after_bad, answered_identically=ok_after,
                                                status=after_bad["status"], token_ids=after_bad["token_ids"])
    if not (alive_after_bad and ok_after):
        failures.append("the DLite server did not answer a good request correctly after the bad inputs")

    # 5. corrupted drafter checkpoints: start-up fails, naming the file
    results["corrupt_checkpoint"] = {}
    for how in corruptions:
        c = corrupt_runs[how].result() if how in corrupt_runs else corrupt_startup(args, how, spec, common, env)
        results["corrupt_checkpoint"][how] = c
        print(f"[corrupt] {how}: exit {c['returncode']} in {c['wall_s']:.0f} s: "
              f"{c['error'][-200:] if c['error'] else 'NO MESSAGE'}", flush=True)
        if c["returncode"] in (0, None) or not c["names_file"]:
            failures.append(f"corrupted checkpoint ({how}): exit {c['returncode']}, file named: {c['names_file']}")

    from lab.harness.runners import runner_from_log

    results["runners_used"] = {name: runner_from_log((args.out / f"{name}.log").read_text(errors="replace"))
                               for name in ("reference", "dlite")}
    if set(results["runners_used"].values()) != {args.runner}:
        failures.append(f"--runner {args.runner}: the servers used {results['runners_used']}")
    results["wall_s"] = round(time.time() - t_start, 1)
    results["failures"] = failures
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(args.out / "results.md", results)
    print((args.out / "results.md").read_text())
    return 1 if failures else 0


def write_markdown(path: Path, res: dict) -> None:
    s, load = res["settings"], res["load"]
    lines = [
        "# Serving under load and faults (DLite)", "",
        f"target `{s['target']}`, drafter `{s['drafter']}`, K={s['k']}, greedy, {s['requests']} concurrent streamed "
        f"chat requests with tools per round ({min(s['prompt_tokens'])}-{max(s['prompt_tokens'])} prompt tokens, "
        f"max {s['max_tokens']} new, max model len {s['max_model_len']}), {s['abort_fraction']:.0%} aborted, KV pool "
        f"{s['kv_tokens']:,} tokens for {s['kv_tokens_needed_at_once']:,} needed at once"
        f"{', eager (no compilation)' if s.get('enforce_eager') else ''}, device {s['device']}.", "",
        "| round | sent | completed | aborted | mismatches | prefix mismatches | preemptions | errors | wall s | "
        "RSS MiB at end |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in load["rounds"]:
        lines.append(f"| {r['round']} | {r['sent']} | {r['completed']} | {r['aborted']} | {r['mismatches']} | "
                     f"{r['prefix_mismatches']} | {r['preemptions']:.0f} | {r['errors'] or 0} | {r['wall_s']} | "
                     f"{r['rss_bytes_end'] / 2**20:.0f} |")
    lines += ["", f"Preemptions in all: {load['preemptions']:.0f}. Resident memory growth after warm-up: "
              f"{100 * load['rss_growth_after_warmup']:.2f}%. Spec decode: {load['spec_decode']}.", "",
              "| bad input | status without speculation | status with DLite | error type | same |",
              "| --- | --- | --- | --- | --- |"]
    for name in BAD_INPUTS:
        b = res["bad_input"].get(name)
        if b:
            lines.append(f"| {name} | {b['reference_status']} | {b['dlite_status']} | {b['dlite_type']} | {b['same']} |")
    lines += ["", f"Served after the bad inputs: {res['bad_input'].get('served_after')}.", ""]
    if res["corrupt_checkpoint"]:
        lines += ["| corrupted drafter | exit code | s | error |", "| --- | --- | --- | --- |"]
        for how, c in res["corrupt_checkpoint"].items():
            lines.append(f"| {how} | {c['returncode']} | {c['wall_s']} | {(c['error'] or 'none').replace('|', '/')} |")
    lines += ["", f"Wall time {res['wall_s']:.0f} s. Failures: {res['failures'] or 'none'}.", "",
              f"Command: `{s['command']}`", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
