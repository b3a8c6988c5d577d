"""Third stage of the tiny target recipe: whole agent sessions up to the 32k window.

    .venv/bin/python -m lab.target.long --target models/qwen3-tiny-stdlib \\
        --out models/qwen3-tiny-stdlib --time-budget-s 3600

Pre-training saw windows of 1,024 tokens (and a few of 8,192) and SFT windows of <= 1,024, so the
target wrote malformed calls past ~3k prompt tokens and 2-token endings past ~9k. This stage
fine-tunes on what agents send: each step takes one training-split agentic session from its
start (system prompt, tools, every tool result) up to the end of an assistant turn at <= L tokens,
with the loss on *every* assistant turn of it (``CE_assistant + 0.1 * CE_all``). L follows a
length curriculum: up to 8k for the first quarter of the run, 16k for the second, then the full
window (``--curriculum full``: the full window from the first step); a share of steps
(``--short-share``) trains on short code/chat sessions instead, so that the short skills stay.
With ``--file-sessions N``, a share of the long steps (``--file-share``) trains on whole-file code
sessions no longer than the step's length cap (their lengths drawn uniformly up to it), N per
context in ``--file-contexts``: ``file`` (complete a body given the whole file before it) and
``docstring`` (write back a docstring removed from the whole file): long prompts whose reply is
not a copy of them. Gradient checkpointing keeps 30k-token steps within ~6 GB on CPU.

Resumable: every ``--save-every-s`` seconds the model, optimizer, step and elapsed time go to
``--state``; rerunning the same command continues from there (the schedule follows the elapsed
fraction of ``--time-budget-s``, or ``step / --steps``). The stage appends itself to
``training_report.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from .sft import append_stage, assistant_spans, pad_batch, supervised_step, turn_markers
from .train import add_device_arguments, render_sessions, resolve_device

CURRICULUM = ((0.25, 8192), (0.5, 16384), (1.0, None))  # (until this fraction of the run, max tokens)


def length_cap(progress: float, max_len: int, curriculum: str = "grow") -> int:
    if curriculum == "full":
        return max_len
    return next(cap or max_len for until, cap in CURRICULUM if progress < until or until == 1.0)


def session_docs(tok, kind: str, n: int, seed: int, context: str = "lines") -> list[list[int]]:
    from vllm_dlite.train.workloads.generator import generate

    return render_sessions(tok, generate(kind, "train", n, seed, context=context))


def supervised_window(doc: list[int], spans: list[tuple[int, int]], cap: int,
                      rng: random.Random) -> tuple[list[int], list[int]]:
    """The session from its start to the end of an assistant turn at <= ``L`` tokens, L drawn
    uniformly in [cap / 2, cap]; the mask marks every assistant token in it."""
    limit = rng.randint(cap // 2, cap)
    ends = [stop for _, stop in spans if stop <= limit] or [min(spans[0][1], limit)]
    stop = ends[-1]
    mask = [0] * stop
    for a, b in spans:
        for i in range(a, min(b, stop)):
            mask[i] = 1
    return doc[:stop], mask


def file_session_near(items: list, length: int, rng: random.Random, pool: int = 8):
    """One of the ``pool`` whole-file sessions nearest ``length`` tokens. The step draws the length
    uniformly up to its cap, so prompts of every length are trained about equally often; drawn
    from all sessions alike, nine in ten steps would be under 16k (the generator makes mostly
    short files)."""
    return rng.choice(sorted(items, key=lambda it: abs(len(it[0]) - length))[:pool])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/qwen3-tiny-stdlib", help="weights to start from")
    ap.add_argument("--out", help="where to save the result (default: --target, in place)")
    ap.add_argument("--state", default="runs/target-long/state.pt", help="resumable training state")
    ap.add_argument("--sessions", type=int, default=200, help="training-split agentic sessions")
    ap.add_argument("--short-sessions", type=int, default=500, help="training-split code and chat sessions, each")
    ap.add_argument("--short-share", type=float, default=0.2, help="share of steps on a batch of short sessions")
    ap.add_argument("--short-batch", type=int, default=8)
    ap.add_argument("--file-sessions", type=int, default=0,
                    help="training-split whole-file code completions (0: agentic sessions only)")
    ap.add_argument("--file-contexts", default="file",
                    help="comma-separated generator contexts of the whole-file sessions: file, docstring")
    ap.add_argument("--file-share", type=float, default=0.5, help="share of long steps on them")
    ap.add_argument("--max-len", type=int, default=30720, help="longest window (tokens)")
    ap.add_argument("--curriculum", choices=("grow", "full"), default="grow",
                    help="grow: caps 8k / 16k / --max-len by quarter / quarter / half of the run; "
                    "full: every step at --max-len (a run from weights that did the curriculum)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--all-token-weight", type=float, default=0.1)
    ap.add_argument("--save-every-s", type=float, default=600)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device = resolve_device(ap, args)
    file_contexts = args.file_contexts.split(",")
    if not set(file_contexts) <= {"file", "docstring"}:
        ap.error(f"--file-contexts takes file and/or docstring, got {args.file_contexts!r}")
    if args.max_len < 8192:
        ap.error(f"--max-len must be >= 8192 (the curriculum's first cap), got {args.max_len}")

    from transformers import AutoTokenizer, Qwen3ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out or args.target)
    tok = AutoTokenizer.from_pretrained(args.target)
    model = Qwen3ForCausalLM.from_pretrained(args.target, dtype=torch.float32, attn_implementation="sdpa").to(device)
    if args.max_len > model.config.max_position_embeddings:
        ap.error(f"--max-len {args.max_len} exceeds the target's max_position_embeddings "
                 f"{model.config.max_position_embeddings}")
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()

    t0 = time.time()
    long_docs = session_docs(tok, "agentic", args.sessions, args.seed)
    short_docs = (session_docs(tok, "code", args.short_sessions, args.seed)
                  + session_docs(tok, "chat", args.short_sessions, args.seed))
    header, end_id = turn_markers(tok)
    long_items = [(d, assistant_spans(d, header, end_id)) for d in long_docs]
    file_docs = [d for c in file_contexts for d in session_docs(tok, "code", args.file_sessions, args.seed, context=c)]
    file_items = [(d, assistant_spans(d, header, end_id)) for d in file_docs]
    short_items = [(d, assistant_spans(d, header, end_id)) for d in short_docs]
    print(f"[long] {len(long_items)} agentic sessions ({sum(map(len, long_docs)):,} tokens, longest "
          f"{max(map(len, long_docs)):,}), {len(file_items)} whole-file sessions ({args.file_contexts}) "
          f"({sum(map(len, file_docs)):,} tokens), {len(short_items)} short ({time.time() - t0:.0f}s)", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(args.seed)
    step, elapsed, tokens, log = 0, 0.0, 0, []
    state_path = Path(args.state)
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step, elapsed, tokens, log = st["step"], st["elapsed"], st["tokens"], st["log"]
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        print(f"[long] resumed from {state_path} at step {step}, {elapsed:.0f}s done", flush=True)

    def save_state() -> None:
        state_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step, elapsed=elapsed,
                        tokens=tokens, log=log, rng=rng.getstate(), torch_rng=torch.get_rng_state()),
                   state_path.with_suffix(".tmp"))
        state_path.with_suffix(".tmp").replace(state_path)

    def progress() -> float:
        return elapsed / args.time_budget_s if args.time_budget_s else step / args.steps

    last_save = time.time()
    while (p := progress()) < 1.0:
        t_step = time.time()
        lr = args.lr * min(1.0, max(p, 1e-3) / 0.05) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
        for g in opt.param_groups:
            g["lr"] = lr
        cap = length_cap(p, args.max_len, args.curriculum)
        if rng.random() < args.short_share:
            rows = [supervised_window(d, s, 4096, rng) for d, s in rng.sample(short_items, args.short_batch)]
            kind = "short"
        elif (fits := [it for it in file_items if len(it[0]) <= cap]) and rng.random() < args.file_share:
            doc, spans = file_session_near(fits, rng.randint(0, cap), rng)
            rows = [(doc, [int(any(a <= i < b for a, b in spans)) for i in range(len(doc))])]
            kind = "file"
        else:
            rows = [supervised_window(*rng.choice(long_items), cap, rng)]
            kind = "long"
        ids, mask, valid = pad_batch([r for r, _ in rows], [m for _, m in rows], tok.pad_token_id)
        ce_asst, ce_all = supervised_step(model, opt, ids, mask, valid, args.all_token_weight)
        step += 1
        tokens += int(valid.sum())
        elapsed += time.time() - t_step
        log.append(dict(step=step, kind=kind, tokens_in_step=int(valid.sum()), cap=cap, lr=round(lr, 7),
                        assistant_ce=round(ce_asst.item(), 4), all_ce=round(ce_all.item(), 4),
                        elapsed_s=round(elapsed)))
        print(f"[long] step {step} {kind} {int(valid.sum()):>6} tok cap {cap} lr {lr:.2e} "
              f"assistant CE {ce_asst.item():.3f} all CE {ce_all.item():.3f} {elapsed / 60:.1f} min", flush=True)
        if time.time() - last_save > args.save_every_s:
            save_state()
            last_save = time.time()
    save_state()

    out.mkdir(parents=True, exist_ok=True)
    if out != Path(args.target):
        for f in Path(args.target).iterdir():  # tokenizer, template, configs, report
            if f.is_file() and f.suffix != ".safetensors":
                (out / f.name).write_bytes(f.read_bytes())
    with open(out / "train_log_long.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in log)
    model.config.use_cache = True
    model.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)
    append_stage(out, dict(
        stage="long", steps=step, time_budget_s=args.time_budget_s or None, device=str(device),
        max_len=args.max_len, curriculum=[list(c) for c in CURRICULUM] if args.curriculum == "grow" else "full",
        short_share=args.short_share,
        sessions=args.sessions, short_sessions=args.short_sessions, file_sessions=args.file_sessions,
        file_contexts=file_contexts if args.file_sessions else None,
        file_share=args.file_share if args.file_sessions else None, lr=args.lr, training_tokens=tokens,
        train_wall_s=round(elapsed), torch_threads=torch.get_num_threads(),
        command="python -m lab.target.long " + " ".join(argv if argv is not None else sys.argv[1:])))


if __name__ == "__main__":
    main()
