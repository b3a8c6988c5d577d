#!/usr/bin/env python3
"""Structured output and tool calls under DLite, through ``vllm serve``: identity, validity and tau
with and without the grammar on the same prompts.

    .venv/bin/python benchmarks/structured_tau.py --runner v1 --out benchmarks/results/structured-output/v1
    .venv/bin/python benchmarks/structured_tau.py --runner v2 --out benchmarks/results/structured-output/v2

Two servers side by side on the shipped tiny target (fp32, eager, greedy, the hermes tool parser):
a plain one (no speculation) and one with ``{"method": "dlite", ...}``. For every case each prompt is
sent twice to both: once FREE (no constraint) and once CONSTRAINED. Cases:

* ``json_object`` / ``json_schema`` / ``regex``: vLLM's structured outputs (a grammar masks the
  target's logits at every position, drafted ones included);
* ``tool_required`` / ``tool_named``: ``tool_choice`` "required" / a named tool (vLLM turns both into a
  JSON-schema grammar over the tool-call format);
* ``tool_auto``: ``tool_choice`` "auto": no grammar, the hermes parser reads the text (so "constrained"
  differs from "free" only by the tools in the prompt).

Terms: ``tau`` = tokens per target verification = 1 + accepted draft tokens / drafts, from the DLite
server's ``/metrics`` deltas over the case's requests (sent one at a time, so the deltas are theirs).
``identical``: the DLite reply equals the plain server's token for token; ``valid``: the reply parses
(JSON, matches the regex, or carries parseable tool calls), counted over the replies that finished:
one cut at ``max_tokens`` (``truncated``; the tiny target may fill a JSON string or whitespace until
then, with or without speculation) cannot parse; ``alive``: ``/health`` after the case.
A draft the grammar forbids is rejected at verification, so constrained tau may be lower.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lab.harness.runners import default_runner, runner_env, runner_from_log  # noqa: E402
from lab.harness.server import VLLMServer  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": name, "description": what, "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name, what in (("read_file", "Read a file"), ("list_dir", "List a directory"))
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
REGEX = r"(yes|no), [a-z]{3,8}\."
TOOL_PROMPTS = ["List the files in the src directory, then read src/main.py.",
                "Read the file setup.py and tell me its version.",
                "What is in the tests directory?",
                "Open README.md and summarise it."]
TEXT_PROMPTS = ["Describe a person as JSON with a name and an age.",
                "Is Python dynamically typed? Answer yes or no and one word.",
                "Write a short Python function that reverses a string.",
                "Give me a JSON object describing a file: its path and size."]
CASES = {
    "json_object": (TEXT_PROMPTS, {"response_format": {"type": "json_object"}}),
    "json_schema": (TEXT_PROMPTS, {"response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "person", "schema": SCHEMA}}}),
    "regex": (TEXT_PROMPTS, {"structured_outputs": {"regex": REGEX}}),
    "tool_required": (TOOL_PROMPTS, {"tools": TOOLS, "tool_choice": "required"}),
    "tool_named": (TOOL_PROMPTS, {"tools": TOOLS, "tool_choice": {"type": "function",
                                                                  "function": {"name": "list_dir"}}}),
    "tool_auto": (TOOL_PROMPTS, {"tools": TOOLS, "tool_choice": "auto"}),
}
DRAFTS, ACCEPTED = "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"


def valid(case: str, message: dict) -> bool:
    text = message.get("content") or ""
    try:
        if case == "json_object":
            return isinstance(json.loads(text), dict)
        if case == "json_schema":
            value = json.loads(text)
            return isinstance(value.get("name"), str) and isinstance(value.get("age"), int)
        if case == "regex":
            return re.fullmatch(REGEX, text) is not None
        calls = message.get("tool_calls") or []
        if case == "tool_auto" and not calls:
            return True  # "auto" may answer in text; what it calls must parse
        return bool(calls) and all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    except (ValueError, AttributeError, KeyError, TypeError):
        return False


def chat(server: VLLMServer, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    import requests

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, **extra}
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=600)
    data = r.json()
    if r.status_code != 200:
        return {"status": r.status_code, "error": str(data)[:300], "token_ids": [], "message": {}}
    choice = data["choices"][0]
    return {"status": 200, "token_ids": choice["token_ids"], "message": choice["message"],
            "finish_reason": choice["finish_reason"]}


def run_case(plain: VLLMServer, dlite: VLLMServer, model: str, case: str, max_tokens: int) -> dict:
    prompts, constraint = CASES[case]
    out: dict = {"case": case, "prompts": len(prompts)}
    for label, extra in (("free", {}), ("constrained", constraint)):
        before = dlite.metrics()
        replies = [(chat(plain, model, p, max_tokens, extra), chat(dlite, model, p, max_tokens, extra)) for p in prompts]
        after = dlite.metrics()
        drafts, accepted = after.get(DRAFTS, 0) - before.get(DRAFTS, 0), after.get(ACCEPTED, 0) - before.get(ACCEPTED, 0)
        out[label] = {
            "tau": round(1 + accepted / drafts, 3) if drafts else None,
            "drafts": int(drafts), "accepted": int(accepted),
            "ok": sum(a["status"] == b["status"] == 200 for a, b in replies),
            "identical": sum(a["status"] == 200 and a["token_ids"] == b["token_ids"] for a, b in replies),
            "truncated": sum(b.get("finish_reason") == "length" for _, b in replies),
            "valid": sum(b["status"] == 200 and valid(case, b["message"]) for _, b in replies
                         if b.get("finish_reason") != "length") if label == "constrained" else None,
            "errors": [b["error"] for _, b in replies if b["status"] != 200],
            "replies": [{"finish_reason": b.get("finish_reason"), "message": b["message"]} for _, b in replies],
        }
    out["alive"] = dlite.healthy() and plain.healthy()
    return out


def write_markdown(path: Path, results: dict) -> None:
    s = results["settings"]
    lines = [f"# Structured output and tool calls with DLite, Model Runner {s['runner'].upper()}", "",
             f"`{s['command']}`", "",
             f"Target `{s['target']}`, drafter `{s['drafter']}`, K={s['k']}, greedy, {s['max_tokens']} new tokens, "
             f"concurrency 1, {s['device']}, vLLM {s['vllm']}. Same prompts free and constrained; tau from the "
             "DLite server's /metrics deltas.", "",
             "| case | prompts | tau free | tau constrained | identical to plain (free / constrained) "
             "| truncated (constrained) | valid of finished | server alive |", "|---|---|---|---|---|---|---|---|"]
    for r in results["cases"]:
        f, c = r["free"], r["constrained"]
        lines.append(f"| {r['case']} | {r['prompts']} | {f['tau']} | {c['tau']} | {f['identical']} / {c['identical']} "
                     f"| {c['truncated']} | {c['valid']}/{r['prompts'] - c['truncated']} | {'yes' if r['alive'] else 'NO'} |")
    lines += ["", f"Failures: {results['failures'] or 'none'}", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--target", default="models/qwen3-tiny-stdlib")
    ap.add_argument("--drafter", default="models/dlite-qwen3-tiny-stdlib")
    ap.add_argument("-k", "--k", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runner", choices=("v1", "v2"), default=default_runner(),
                    help="vLLM model runner of both servers; v2 on CPU runs through Triton's interpreter")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, from " + ",".join(CASES))
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}: use {','.join(CASES)}")
    import vllm

    args.out.mkdir(parents=True, exist_ok=True)
    flags = ["--dtype", "float32", "--max-model-len", "2048", "--seed", "0", "--enforce-eager", "--max-num-seqs", "4",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "TOKENIZERS_PARALLELISM": "false", **runner_env(args.runner)}
    spec = {"method": "dlite", "model": args.drafter, "num_speculative_tokens": args.k}
    plain = VLLMServer(args.target, *flags, env=env, cwd=REPO, log_path=args.out / "plain.log")
    dlite = VLLMServer(args.target, *flags, "--speculative-config", json.dumps(spec), env=env, cwd=REPO,
                       log_path=args.out / "dlite.log")
    settings = dict(target=args.target, drafter=args.drafter, k=args.k, max_tokens=args.max_tokens, runner=args.runner,
                    vllm=vllm.__version__, device="CPU (2 cores)",
                    command="python benchmarks/structured_tau.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    results: dict = {"settings": settings, "cases": [], "failures": []}
    t0 = time.time()
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(s.start) for s in (plain, dlite)]:
                f.result()
        used = {name: runner_from_log(s.log_tail(10**7)) for name, s in (("plain", plain), ("dlite", dlite))}
        if set(used.values()) != {args.runner}:
            results["failures"].append(f"--runner {args.runner}: the servers used {used}")
        for case in cases:
            r = run_case(plain, dlite, args.target, case, args.max_tokens)
            results["cases"].append(r)
            print(case, {k: {x: y for x, y in v.items() if x != "replies"} if isinstance(v, dict) else v
                         for k, v in r.items()}, flush=True)
            c = r["constrained"]
            if not r["alive"]:
                results["failures"].append(f"{case}: a server died")
            if c["ok"] != r["prompts"] or r["free"]["ok"] != r["prompts"]:
                results["failures"].append(f"{case}: non-200 replies {c['errors'] + r['free']['errors']}")
            if c["identical"] != r["prompts"] or r["free"]["identical"] != r["prompts"]:
                results["failures"].append(f"{case}: DLite differs from the plain server")
            if c["valid"] != r["prompts"] - c["truncated"]:
                results["failures"].append(f"{case}: {r['prompts'] - c['truncated'] - c['valid']} invalid finished replies")
    finally:
        plain.stop()
        dlite.stop()
    results["wall_s"] = round(time.time() - t0, 1)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(args.out / "results.md", results)
    print((args.out / "results.md").read_text())
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
