"""Recipe for the tiny Qwen3 target, trained from scratch on this machine.

    .venv/bin/python -m lab.target.train --out models/qwen3-tiny-stdlib

Steps (all deterministic given ``--seed``):
1. training-split workloads from ``vllm_dlite.train.workloads.generator`` (agentic, code, chat);
2. a byte-level BPE tokenizer (``tokenizers``) on the training-split stdlib source + sessions;
3. a 12-layer ``Qwen3ForCausalLM`` trained with next-token loss on a mix of stdlib source
   (the running interpreter's ``Lib/``, training-split files) and chat-template-rendered
   sessions; a final phase trains on whole agentic sessions of >= 8k tokens;
4. held-out loss on held-out-split sessions and files; weights saved in bf16 with
   ``config.json``, tokenizer files and ``training_report.json``.
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

from vllm_dlite.train.workloads.generator import files_of_split, generate, read_text
from vllm_dlite.train.workloads.replay import chat_token_ids
from .tokenizer import train_tokenizer

TARGET_SHAPE = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=12,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def render_sessions(tokenizer, sessions: list[dict]) -> list[list[int]]:
    return [chat_token_ids(tokenizer, s["messages"], s["tools"], add_generation_prompt=False)
            + [tokenizer.pad_token_id] for s in sessions]


def encode_files(tokenizer, paths: list[str]) -> list[list[int]]:
    eot = tokenizer.pad_token_id
    return [tokenizer.encode(f"# {p}\n" + read_text(p), add_special_tokens=False) + [eot] for p in paths]


class PackedStream:
    """Endless stream of ``seq_len + 1`` windows from shuffled documents of several pools."""

    def __init__(self, pools: list[tuple[list[list[int]], float]], seq_len: int, seed: int):
        self.pools, self.seq_len = pools, seq_len
        self.rng = random.Random(seed)
        self.buf: list[int] = []

    def next_window(self) -> list[int]:
        while len(self.buf) < self.seq_len + 1:
            docs = self.rng.choices([p for p, _ in self.pools], weights=[w for _, w in self.pools])[0]
            self.buf.extend(self.rng.choice(docs))
        window, self.buf = self.buf[: self.seq_len + 1], self.buf[self.seq_len:]
        return window

    def batch(self, batch_size: int) -> torch.Tensor:
        return torch.tensor([self.next_window() for _ in range(batch_size)], dtype=torch.long)


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    batch = batch.to(model.device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=model.device.type == "cuda"):
        logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def mean_loss(model, docs: list[list[int]], seq_len: int, max_windows: int) -> float:
    model.eval()
    stream = PackedStream([(docs, 1.0)], seq_len, seed=1234)
    losses = [lm_loss(model, stream.batch(1)).item() for _ in range(max_windows)]
    model.train()
    return sum(losses) / len(losses)


def add_device_arguments(ap: argparse.ArgumentParser) -> None:
    """``--device`` and ``--time-budget-s``, shared by pre-training and SFT."""
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: cuda when available (bf16 autocast), else cpu (fp32)")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="train for this many seconds instead of a step count: the schedule (and, in "
                         "pre-training, the switch to long sessions) follows the elapsed fraction")


def resolve_device(ap: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The training device; a bad ``--device``/``--time-budget-s`` is one clear error at start-up."""
    if args.time_budget_s < 0:
        ap.error(f"--time-budget-s must be > 0 seconds (0 trains for --steps), got {args.time_budget_s}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device cuda: torch {torch.__version__} sees no CUDA device; use --device cpu or auto")
    return torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                        else "cpu")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/qwen3-tiny-stdlib")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--sessions", type=int, nargs=3, default=[200, 2000, 2000],
                    metavar=("AGENTIC", "CODE", "CHAT"), help="training sessions per kind")
    ap.add_argument("--steps", type=int, default=320, help="steps of phase 1 (seq-len tokens x batch)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--long-steps", type=int, default=20, help="phase 2 steps on whole long sessions")
    ap.add_argument("--long-seq-len", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--init-from", help="continue from this target directory's weights (same tokenizer)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    add_device_arguments(ap)
    args = ap.parse_args(argv)
    device = resolve_device(ap, args)

    from transformers import Qwen3Config, Qwen3ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    n_agentic, n_code, n_chat = args.sessions
    cache = Path("data") / f"target-corpus-{args.seed}-{n_agentic}-{n_code}-{n_chat}-{args.vocab_size}.pt"
    if cache.exists():  # generation + tokenizer are deterministic; reuse them on a rerun
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(out)
        code_docs, session_docs, long_docs, heldout_docs, heldout_code = torch.load(cache)
        print(f"[data] tokenized corpus from {cache}", flush=True)
    else:
        sessions = (generate("agentic", "train", n_agentic, args.seed) + generate("code", "train", n_code, args.seed)
                    + generate("chat", "train", n_chat, args.seed))
        heldout_sessions = (generate("agentic", "heldout", 12, args.seed + 1)
                            + generate("code", "heldout", 64, args.seed + 1) + generate("chat", "heldout", 64, args.seed + 1))
        train_files, heldout_files = files_of_split("train"), files_of_split("heldout")
        print(f"[data] {len(sessions)} train sessions, {len(train_files)} train files ({time.time() - t0:.0f}s)", flush=True)

        def tokenizer_texts():
            for p in train_files:
                yield read_text(p)
            for s in sessions:
                yield json.dumps(s["messages"], ensure_ascii=False)
        tokenizer = train_tokenizer(tokenizer_texts(), args.vocab_size)
        tokenizer.save_pretrained(out)
        print(f"[tokenizer] vocab {len(tokenizer)} ({time.time() - t0:.0f}s)", flush=True)

        code_docs = encode_files(tokenizer, train_files)
        session_docs = render_sessions(tokenizer, sessions)
        long_docs = [d for d, s in zip(session_docs, sessions) if s["kind"] == "agentic" and len(d) >= 8192]
        heldout_docs = render_sessions(tokenizer, heldout_sessions)
        heldout_code = encode_files(tokenizer, heldout_files)
        cache.parent.mkdir(exist_ok=True)
        torch.save((code_docs, session_docs, long_docs, heldout_docs, heldout_code), cache)
    n_code_tok, n_sess_tok = sum(map(len, code_docs)), sum(map(len, session_docs))
    print(f"[corpus] stdlib {n_code_tok:,} tokens, sessions {n_sess_tok:,} tokens, "
          f"{len(long_docs)} agentic sessions >= 8192 tokens ({time.time() - t0:.0f}s)", flush=True)

    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=32768, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                         bos_token_id=eos_ids[1], eos_token_id=eos_ids, pad_token_id=eos_ids[1],
                         **TARGET_SHAPE)
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config)
    previous = None
    if args.init_from:  # a second stage: same architecture and tokenizer, new optimizer and schedule
        init = Qwen3ForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        model.load_state_dict(init.state_dict())
        report_path = Path(args.init_from) / "training_report.json"
        previous = json.loads(report_path.read_text()) if report_path.exists() else None
        del init
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {n_params / 1e6:.2f}M parameters on {device}", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = args.steps + args.long_steps
    long_from = args.steps / total  # fraction of the run after which batches are whole long sessions
    warmup = 1 / 15

    def lr_at(progress: float) -> float:
        if progress < warmup:
            return args.lr * max(progress, 1 / total) / warmup
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (progress - warmup) / (1 - warmup))))

    def progress_at(step: int) -> float:  # fraction of the run done: by steps, or by wall clock
        if args.time_budget_s:
            return (time.time() - t_train) / args.time_budget_s
        return step / total

    mixed = PackedStream([(code_docs, 0.35), (session_docs, 0.65)], args.seq_len, seed=args.seed)
    long_stream = PackedStream([(long_docs or session_docs, 1.0)], args.long_seq_len, seed=args.seed + 7)
    log = open(out / "train_log.jsonl", "w")
    tokens = 0
    interval_losses: list[float] = []
    t_train = time.time()
    model.train()
    step = 0
    while (progress := progress_at(step)) < 1.0:
        batch = mixed.batch(args.batch_size) if progress < long_from else long_stream.batch(1)
        for g in opt.param_groups:
            g["lr"] = lr_at(progress)
        loss = lm_loss(model, batch)
        interval_losses.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += batch[:, 1:].numel()
        step += 1
        if step % 20 == 1 or progress_at(step) >= 1.0:
            el = time.time() - t_train
            done = max(progress_at(step), 1e-9)
            eta = el / done * (1 - done)
            mean = sum(interval_losses) / len(interval_losses)
            interval_losses.clear()
            rec = dict(step=step - 1, loss=round(mean, 4), lr=lr_at(progress), tokens=tokens,
                       seq_len=batch.shape[1] - 1, elapsed_s=round(el), eta_s=round(eta))
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(f"[train] step {step - 1} loss {mean:.3f} tok {tokens:,} "
                  f"{tokens / el:.0f} tok/s eta {eta / 60:.1f} min", flush=True)
    train_s = time.time() - t_train

    stages = (previous or {}).get("stages", [previous] if previous else [])
    report = dict(
        name=out.name, parameters=n_params, shape=TARGET_SHAPE, vocab_size=len(tokenizer),
        training_tokens=tokens, train_wall_s=round(train_s), recipe_wall_s=round(time.time() - t0),
        steps=step, long_steps=args.long_steps, time_budget_s=args.time_budget_s or None, device=str(device),
        seq_len=args.seq_len, long_seq_len=args.long_seq_len,
        batch_size=args.batch_size, corpus_tokens=dict(stdlib=n_code_tok, sessions=n_sess_tok),
        heldout_loss_sessions=round(mean_loss(model, heldout_docs, 1024, 24), 4),
        heldout_loss_stdlib=round(mean_loss(model, heldout_code, 1024, 24), 4),
        train_loss_last=round(loss.item(), 4), torch_threads=torch.get_num_threads(), seed=args.seed,
        command="python -m lab.target.train " + " ".join(argv if argv is not None else sys.argv[1:]),
    )
    report["stages"] = stages + [{k: v for k, v in report.items() if k != "stages"}]
    report["training_tokens_all_stages"] = sum(st["training_tokens"] for st in report["stages"])
    report["train_wall_s_all_stages"] = sum(st["train_wall_s"] for st in report["stages"])
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[1]
    model.to("cpu", torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
