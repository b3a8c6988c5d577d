"""Second stage of the tiny target recipe: supervised fine-tuning on assistant turns.

    .venv/bin/python -m lab.target.sft --target models/qwen3-tiny-stdlib

Pre-training (``train.py``) on ~1.5M tokens leaves the model near the unigram plateau on file
contents; the agent's own turns (short replies and tool calls whose arguments are copied from the
context) are a tiny share of those tokens. This stage trains on windows of the training-split
sessions that end at an assistant turn, with the loss on assistant tokens
(``CE_assistant + 0.1 * CE_all``), as chat models are tuned. It reuses the tokenized corpus cached
by ``train.py`` and appends itself to ``training_report.json``.
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

from .train import add_device_arguments, resolve_device


def assistant_spans(ids: list[int], header: list[int], end_id: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of assistant replies (their ``<|im_end|>`` included)."""
    spans, n, i = [], len(header), 0
    while i < len(ids) - n:
        if ids[i: i + n] == header:
            start = i + n
            stop = start
            while stop < len(ids) and ids[stop] != end_id:
                stop += 1
            spans.append((start, min(stop + 1, len(ids))))
            i = stop
        i += 1
    return spans


def turn_markers(tok) -> tuple[list[int], int]:
    """The token ids that open an assistant turn, and the id that ends every turn (for
    :func:`assistant_spans`)."""
    return tok.encode("<|im_start|>assistant\n", add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")


def pad_batch(rows: list[list[int]], masks: list[list[int]], pad_id: int):
    """Right-pad token rows and their loss masks: ``ids [b, T]``, ``mask [b, T]`` (supervised
    tokens), ``valid [b, T]`` (real tokens)."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
    valid = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.bool)
    return ids, mask, valid


def masked_ce(model, ids: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor):
    """Next-token CE of ``model`` on a :func:`pad_batch` batch: mean over the supervised tokens
    and mean over all real tokens (bf16 autocast on CUDA)."""
    device = model.device
    ids, mask, valid = ids.to(device), mask.to(device), valid.to(device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=ids[:, :-1], attention_mask=valid[:, :-1].long()).logits.float()
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    m, v = mask[:, 1:], valid[:, 1:]
    return (ce * m).sum() / m.sum().clamp(min=1), (ce * v).sum() / v.sum()


def supervised_step(model, opt, ids, mask, valid, all_token_weight: float):
    """One optimizer step on ``CE_assistant + all_token_weight * CE_all`` (gradient norm clipped
    to 1); returns both CEs."""
    ce_asst, ce_all = masked_ce(model, ids, mask, valid)
    loss = ce_asst + all_token_weight * ce_all
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return ce_asst.detach(), ce_all.detach()


def append_stage(out: Path, stage: dict) -> None:
    """Record one training stage in ``out/training_report.json`` (started fresh when missing),
    with the token and wall-time totals over all stages."""
    report_path = out / "training_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {"name": out.name, "stages": []}
    report.setdefault("stages", [{k: v for k, v in report.items() if k != "stages"}])
    report["stages"].append(stage)
    report["training_tokens_all_stages"] = sum(s["training_tokens"] for s in report["stages"])
    report["train_wall_s_all_stages"] = sum(s["train_wall_s"] for s in report["stages"])
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(stage, indent=2))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/qwen3-tiny-stdlib")
    ap.add_argument("--corpus", default="data/target-corpus-0-200-2000-2000-8192.pt",
                    help="tokenized corpus cached by lab.target.train")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--window", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--all-token-weight", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device = resolve_device(ap, args)

    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.target)
    tok = AutoTokenizer.from_pretrained(out)
    model = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).to(device)
    model.train()
    _, session_docs, _, heldout_docs, _ = torch.load(args.corpus)
    header, end_id = turn_markers(tok)
    items = [(d, s) for d in session_docs for s in assistant_spans(d, header, end_id)]
    held = [(d, s) for d in heldout_docs for s in assistant_spans(d, header, end_id)]
    print(f"[sft] {len(items)} assistant turns in {len(session_docs)} sessions", flush=True)

    def make_batch(pool, n, r):
        rows, masks = [], []
        for doc, (start, stop) in r.sample(pool, n):
            lo = max(0, stop - args.window - 1)
            rows.append(doc[lo:stop])
            masks.append([0] * (max(start, lo) - lo) + [1] * (stop - max(start, lo)))
        return pad_batch(rows, masks, tok.pad_token_id)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0, tokens, hist = time.time(), 0, []

    def progress_at(step: int) -> float:  # fraction of the run done: by steps, or by wall clock
        return (time.time() - t0) / args.time_budget_s if args.time_budget_s else step / args.steps

    step = 0
    while (progress := progress_at(step)) < 1.0:
        lr = args.lr * min(1.0, max(progress, 1 / args.steps) * 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, mask, valid = make_batch(items, args.batch_size, rng)
        ce_asst, ce_all = supervised_step(model, opt, ids, mask, valid, args.all_token_weight)
        tokens += int(valid.sum())
        hist.append(ce_asst.item())
        step += 1
        if step % 20 == 1 or progress_at(step) >= 1.0:
            el = time.time() - t0
            done = max(progress_at(step), 1e-9)
            print(f"[sft] step {step - 1} assistant CE {sum(hist) / len(hist):.3f} all CE {ce_all.item():.3f} "
                  f"tok {tokens:,} eta {el / done * (1 - done) / 60:.1f} min", flush=True)
            hist.clear()
    wall = time.time() - t0

    model.eval()
    with torch.no_grad():
        r = random.Random(1234)
        evals = [masked_ce(model, *make_batch(held, 4, r)) for _ in range(8)]
    stage = dict(
        stage="sft", steps=step, time_budget_s=args.time_budget_s or None, device=str(device), window=args.window, batch_size=args.batch_size, lr=args.lr,
        training_tokens=tokens, train_wall_s=round(wall),
        heldout_assistant_ce=round(sum(e[0].item() for e in evals) / len(evals), 4),
        heldout_all_ce=round(sum(e[1].item() for e in evals) / len(evals), 4),
        command="python -m lab.target.sft " + " ".join(argv if argv is not None else sys.argv[1:]))
    model.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)
    append_stage(out, stage)

if __name__ == "__main__":
    main()
