"""Evaluate the tiny target on held-out agentic turns: well-formed tool calls and samples.

    .venv/bin/python -m vllm_dlite.target.evaluate --target models/qwen3-tiny-stdlib

A reply is a *well-formed tool call* when it contains ``<tool_call>\\n{json}\\n</tool_call>`` blocks
(the markup of the chat template, parsed the way vLLM's hermes tool parser does), each JSON object
naming a tool of the session with an ``arguments`` object holding every required parameter.
Only turns whose reference reply is a tool call are scored. Greedy decoding in vLLM (fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

TOOL_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/qwen3-tiny-stdlib")
    ap.add_argument("--workload", default="benchmarks/workloads/heldout_agentic.jsonl")
    ap.add_argument("--max-prompt-tokens", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=3, help="sample replies to print")
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from ..workloads.replay import load_replay
    from ..workloads.schema import read_sessions

    tok = AutoTokenizer.from_pretrained(args.target)
    tools = {s["id"]: s["tools"] for s in read_sessions(args.workload)}
    reqs = [r for r in load_replay(args.workload, tok, max_prompt_tokens=args.max_prompt_tokens)
            if r.reference.get("tool_calls")]
    llm = LLM(model=args.target, dtype="float32", max_model_len=args.max_prompt_tokens + args.max_tokens,
              seed=0, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                        SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    ok = [well_formed_tool_calls(t, tools[r.session_id]) for t, r in zip(texts, reqs)]
    # A well-formed reply has a parseable first call; compare its tool with the reference's.
    same_tool = [k and json.loads(TOOL_CALL_RE.search(t).group(1))["name"]
                 == r.reference["tool_calls"][0]["function"]["name"]
                 for t, r, k in zip(texts, reqs, ok)]
    report = {
        "target": args.target, "workload": args.workload, "turns_scored": len(reqs),
        "well_formed_tool_calls": sum(ok) / len(ok),
        "same_tool_as_reference": sum(same_tool) / len(same_tool),
        "mean_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs) / len(outs),
        "samples": [{"prompt_tail": tok.decode(r.prompt_token_ids[-60:]), "reply": t}
                    for r, t in list(zip(reqs, texts))[: args.samples]],
        "command": "python -m vllm_dlite.target.evaluate " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
