"""Evaluate the tiny target on held-out agentic turns, per prompt-length bucket.

    .venv/bin/python -m lab.target.evaluate --target models/qwen3-tiny-stdlib \\
        --out models/qwen3-tiny-stdlib/eval_heldout_agentic.json

Per bucket of prompt tokens (``BUCKETS``: 0-2k, 2k-4k, 4k-8k, 8k-16k, 16k-32k):

* ``well_formed_tool_calls``: among turns whose reference reply is a tool call, the share of greedy
  replies holding ``<tool_call>\\n{json}\\n</tool_call>`` blocks (the chat template's markup, parsed
  as vLLM's hermes tool parser does), each naming a tool of the session with an ``arguments``
  object that has every required parameter;
* ``same_tool_as_reference``: the first call names the reference's tool;
* ``well_formed_code_replies``: among turns whose reference reply is a code block (code
  completion, e.g. ``heldout_code_long_file.jsonl``), the share of greedy replies that are one
  finished, non-empty ```` ```python ```` block whose body parses as a function body;
* ``well_formed_docstrings``: among turns whose reference reply is a docstring in a code block
  (``heldout_code_docstring.jsonl``: write back a docstring removed from a whole file), the share
  of greedy replies that are one finished block holding one string literal of >= 3 words;
* ``mean_output_tokens`` and ``short_endings`` (replies of <= 2 tokens, the failure mode of a
  target that does not cope with long inputs), over the scored turns;
* ``heldout_assistant_ce``: next-token cross-entropy on the reference assistant tokens of every
  turn in the bucket (teacher forcing over the whole session in HF transformers, fp32).

Greedy decoding in vLLM (fp32, prefix caching on: turns of one session share their prefix).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import textwrap

TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
CODE_BLOCK_RE = re.compile(r"```python\n(.*)\n```", re.DOTALL)
BUCKETS = ((0, 2048, "0-2k"), (2048, 4096, "2k-4k"), (4096, 8192, "4k-8k"),
           (8192, 16384, "8k-16k"), (16384, 32768, "16k-32k"))


def bucket_of(prompt_tokens: int) -> str | None:
    return next((name for lo, hi, name in BUCKETS if lo <= prompt_tokens < hi), None)


def well_formed_tool_calls(text: str, tools: list[dict]) -> bool:
    blocks = TOOL_CALL_RE.findall(text)
    if not blocks:
        return False
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    for block in blocks:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return False
        if not isinstance(call, dict) or call.get("name") not in schemas:
            return False
        args = call.get("arguments")
        if not isinstance(args, dict) or not set(schemas[call["name"]].get("required", [])) <= set(args):
            return False
    return True


def well_formed_code_reply(text: str) -> bool:
    """One finished ```` ```python ```` block, nothing around it, with a body that is not blank
    and parses as the body of a function (a code-completion reply, not a copy of the prompt's
    markup)."""
    m = CODE_BLOCK_RE.fullmatch(text.strip())
    if m is None or not m.group(1).strip():
        return False
    try:
        ast.parse("def _f():\n" + textwrap.indent(textwrap.dedent(m.group(1)), "    "))
    except SyntaxError:
        return False
    return True


def docstring_of(text: str) -> str | None:
    """The string of a reply that is one finished ```` ```python ```` block holding one string
    literal and nothing else, else None."""
    m = CODE_BLOCK_RE.fullmatch(text.strip())
    try:
        body = ast.parse(textwrap.dedent(m.group(1))).body if m else []
    except SyntaxError:
        return None
    if len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].value.value
    return None


def well_formed_docstring(text: str) -> bool:
    return len((docstring_of(text) or "").split()) >= 3


def scored_kind(reference: dict) -> str | None:
    """What a turn's reply is scored as: ``"tool"`` (its reference calls a tool), ``"docstring"``
    (its reference is a code block holding only a docstring), ``"code"`` (another code block), else
    None (not scored)."""
    if reference.get("tool_calls"):
        return "tool"
    content = str(reference.get("content") or "")
    if not content.lstrip().startswith("```python"):
        return None
    return "docstring" if docstring_of(content) is not None else "code"


def first_tool_name(text: str) -> str | None:
    """The tool named by the reply's first call (None when the reply is not a well-formed call)."""
    m = TOOL_CALL_RE.search(text)
    return json.loads(m.group(1))["name"] if m else None


def assistant_ce_by_bucket(target: str, sessions: list[dict], max_tokens: int) -> dict[str, dict]:
    """Teacher-forced CE on each session's assistant tokens, grouped by the bucket of the prompt
    before each assistant turn. Sessions are truncated to ``max_tokens``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dlite.train.workloads.replay import chat_token_ids
    from .sft import assistant_spans, turn_markers

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    header, end_id = turn_markers(tok)
    sums: dict[str, list[float]] = {}
    for s in sessions:
        ids = chat_token_ids(tok, s["messages"], s["tools"], add_generation_prompt=False)[:max_tokens]
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]])).logits[0]
        ce = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
        for start, stop in assistant_spans(ids, header, end_id):
            name = bucket_of(start)
            if name is None:
                continue
            acc = sums.setdefault(name, [0.0, 0])
            acc[0] += float(ce[start - 1: stop - 1].sum())  # logits at t predict token t + 1
            acc[1] += stop - start
    return {name: {"heldout_assistant_ce": round(total / n, 4), "assistant_tokens": n}
            for name, (total, n) in sums.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/qwen3-tiny-stdlib")
    ap.add_argument("--workload", default="benchmarks/workloads/heldout_agentic.jsonl")
    ap.add_argument("--max-prompt-tokens", type=int, default=30000,
                    help="skip later turns of a session once its prompt is longer (the target's window is 32k)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-loss", action="store_true", help="skip the teacher-forced held-out CE (HF, slow)")
    ap.add_argument("--samples", type=int, default=1, help="sample replies to keep per bucket")
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--table", metavar="REPORT", help="print the table of a saved report and stop (no model runs)")
    ap.add_argument("--before", metavar="REPORT", help="with --table: a saved report to compare against")
    args = ap.parse_args(argv)
    if args.table:
        load = (lambda p: json.load(open(p)) if p else None)
        print(format_table(load(args.table), load(args.before)))
        return
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_dlite.vllm.engine import build_llm, shutdown, use_cpu_env

    from vllm_dlite.train.workloads.replay import load_replay
    from vllm_dlite.train.workloads.schema import read_sessions

    tok = AutoTokenizer.from_pretrained(args.target)
    sessions = list(read_sessions(args.workload))
    tools = {s["id"]: s["tools"] for s in sessions}
    reqs = [r for r in load_replay(args.workload, tok, max_prompt_tokens=args.max_prompt_tokens)
            if scored_kind(r.reference)]
    use_cpu_env(4)  # GiB: 8 prompts of 30k tokens fit
    llm = build_llm(args.target, None, dtype="float32", max_model_len=args.max_prompt_tokens + args.max_tokens,
                    seed=0, max_num_seqs=8, enable_prefix_caching=True)
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    shutdown(llm)

    rows: dict[str, list[dict]] = {name: [] for _, _, name in BUCKETS}
    for r, o in zip(reqs, outs):
        text, n_out = o.outputs[0].text, len(o.outputs[0].token_ids)
        kind = scored_kind(r.reference)
        ok = (well_formed_tool_calls(text, tools[r.session_id]) if kind == "tool"
              else well_formed_docstring(text) if kind == "docstring" else well_formed_code_reply(text))
        rows[bucket_of(len(r.prompt_token_ids))].append(dict(
            prompt_tokens=len(r.prompt_token_ids), kind=kind, ok=ok, output_tokens=n_out,
            same_tool=kind == "tool" and ok
            and first_tool_name(text) == r.reference["tool_calls"][0]["function"]["name"],
            prompt_tail=tok.decode(r.prompt_token_ids[-40:]), reply=text))
    losses = {} if args.no_loss else assistant_ce_by_bucket(args.target, sessions, args.max_prompt_tokens)

    def share(rs: list[dict], key: str):
        return round(sum(x[key] for x in rs) / len(rs), 4) if rs else None

    def summary(rs: list[dict]) -> dict:
        n = len(rs)
        tool, code, doc = ([x for x in rs if x["kind"] == kind] for kind in ("tool", "code", "docstring"))
        return dict(turns_scored=n,
                    well_formed_tool_calls=share(tool, "ok"), well_formed_code_replies=share(code, "ok"),
                    well_formed_docstrings=share(doc, "ok"),
                    same_tool_as_reference=share(tool, "same_tool"),
                    mean_output_tokens=round(sum(x["output_tokens"] for x in rs) / n, 1) if n else None,
                    short_endings=sum(x["output_tokens"] <= 2 for x in rs))

    everything = [x for rs in rows.values() for x in rs]
    report = {
        "target": args.target, "workload": args.workload, "max_tokens": args.max_tokens,
        **summary(everything),
        "by_bucket": {name: {"prompt_tokens": f"{lo}-{hi - 1}", **summary(rows[name]), **losses.get(name, {}),
                             "samples": [{k: x[k] for k in ("prompt_tokens", "prompt_tail", "reply")}
                                         for x in rows[name][: args.samples]]}
                      for lo, hi, name in BUCKETS},
        "command": "python -m lab.target.evaluate " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "by_bucket"}, indent=2))
    print(format_table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def format_table(report: dict, before: dict | None = None) -> str:
    """The per-bucket figures as a markdown table (the model card quotes it); with ``before``,
    each cell reads ``before -> after``."""
    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def cells(b: dict) -> list[str]:
        return [str(b["turns_scored"]), pct(b["well_formed_tool_calls"]), pct(b["same_tool_as_reference"]),
                pct(b.get("well_formed_code_replies")), pct(b.get("well_formed_docstrings")),
                str(b["mean_output_tokens"]), str(b["short_endings"]),
                str(b.get("heldout_assistant_ce", "-"))]

    lines = ["| prompt tokens | turns | well-formed tool calls | same tool | well-formed code replies "
             "| well-formed docstrings | mean output tokens | 2-token endings | held-out assistant CE |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, b in report["by_bucket"].items():
        now = cells(b)
        if before is not None:
            was = cells(before["by_bucket"][name])
            now = [now[0]] + [f"{w} -> **{n}**" for w, n in zip(was[1:], now[1:])]
        lines.append(f"| {name} | " + " | ".join(now) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
