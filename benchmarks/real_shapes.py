#!/usr/bin/env python3
"""Real-shape end-to-end check on this CPU (issue 36, deliverable 2): the authors' Qwen3-4B DLite
layout served by vLLM on Model Runner V1 and V2, and the Qwen3-8B layout loaded and validated.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_shapes.py            # both runners + 8B
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_shapes.py --runners v1 --no-8b

Contract (what a run builds, checks and writes):

* **Target** (:func:`write_target`): a random-weight ``Qwen3ForCausalLM`` with Qwen3-4B's
  config.json (hidden 2560, 36 layers, 32 heads / 8 KV heads, head_dim 128, vocab 151,936, tied
  embeddings, rope_theta 1e6, max positions 40,960) except ``intermediate_size`` (9728 -> 1024 by
  default, ``--target-intermediate``: the target's MLP does not touch anything DLite reads, and the
  full one would not fit beside the drafter in this machine's memory), stored **bf16, sharded with
  a model.safetensors.index.json**, as the real checkpoint is. Weights N(0, 0.25) with every
  ``o_proj`` / ``down_proj`` scaled by 0.08 (``make_tiny_target``'s idea, ``tests/helpers_vllm.py``):
  the logits' spread is ~12, so greedy argmaxes are decisive and numeric noise between batch shapes
  does not flip them. Its tokenizer is the project's small byte-level BPE
  (``lab.target.tokenizer``, 512 ids, ``<|mask|>`` included); prompts are random token ids over the
  whole 151,936-id vocabulary (``TokensPrompt``) and outputs are compared as token ids
  (``detokenize=False``: most ids have no text in the small tokenizer).
* **Drafter** (:func:`write_drafter`): a random ``DLiteDrafter`` in the authors' layout at Qwen3-4B
  shapes (docs/dlite_v1.md §7): 5 draft layers, full intermediate size 9728, L = 14 features
  (``target_layer_ids`` by the authors' rule for N = 36), rank 320, B = 8 (K = 7), G = 1,
  ``mask_token_id`` = the tokenizer's ``<|mask|>``; 603,322,560 parameters (checked); matrices
  N(0, 0.2); written with ``vllm_dlite.model.save_pretrained`` in bf16 and split into 3 shards + index
  (:func:`shard_checkpoint`).
* **Serving** (:func:`serve`, per runner, each engine in a fresh process: ``v1`` plain, ``v2``
  through Triton's interpreter, :func:`lab.harness.runners.call_with_runner`): vLLM's in-process
  engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``, one OpenMP
  thread), ``enforce_eager``, ``max_model_len`` 1,100, ``max_num_seqs`` 4, prefix caching off,
  ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-gib`` for both engines, dtype ``--dtype`` (fp32 by default;
  the bf16 weights are upcast). No speculation, then ``{"method": "dlite"}``, on the same prompts
  (``--prompt-lens``, default 64 / 256 / 512 / 1,000 tokens), greedy, ``--max-tokens`` new tokens
  each, ``ignore_eos``. Checked: DLite's token ids identical to no speculation's for every prompt
  (``identical`` counts), and the KV pool (``cache_config.num_gpu_blocks``) equal to no
  speculation's.
* **CPU timings** (one OpenMP thread; CPU figures, not a GPU's): after the batch, each engine runs
  the first prompt alone for ``--timing-tokens`` tokens. ``decode_step_ms``: the no-speculation
  engine's inter-token latency at batch 1 ((last token - first token) / (tokens - 1), vLLM's
  per-request engine-core timestamps). ``draft_round_ms``: the median wall time of
  ``DFlashDLiteDraftModel.propose_drafts`` (one DLite round: 5-layer backbone + 7 head steps),
  wrapped in-process, over that request's rounds at batch 1 (the batch run's rounds are kept per
  batch size as well). ``dlite_step_ms``: the DLite engine's time per round at batch 1 (draft +
  verify of 8 tokens), for comparison.
* **Qwen3-8B** (:func:`validate_8b`, no serving; ``--no-8b`` skips): a random drafter at 8B shapes
  (hidden 4096, intermediate 12,288, rank 512, 14 features, 5 layers; 1,123,879,680 parameters)
  saved bf16 in 3 shards + index, accepted by ``prepare_speculative_config`` against Qwen3-8B's
  config, loaded back through ``load_drafter`` (fp32) with every tensor's checksum equal to what was
  saved, bound to a random [151,936, 4096] embedding, and one greedy draft round run.
* Peak memory: ``ru_maxrss`` of each fresh process (one engine or the 8B check at a time).

Writes ``--out``/results.json (everything above, plus each engine's wall time and load time) and
results.md (a summary). Exits non-zero when an output differs or a KV pool differs.

Why a script and not a slow test: one runner's check does not fit what a test may take here
(about 3 minutes and 12 GiB). On Model Runner V1 (this run, 2-core host) the engine without
speculation took 165 s at a peak RSS of 12.3 GiB and the DLite engine 353 s at 14.9 GiB (the fp32
target is 6.5 GB and the fp32 drafter 2.4 GB at these shapes, plus the KV pool and the mmapped bf16
shards), i.e. ~9 minutes with the model build; Model Runner V2 runs through Triton's interpreter
and is slower still. The small-shape end-to-end checks on both runners stay in
``tests/test_vllm_integration.py``; the real-shape config-time checks in
``tests/test_real_shape_errors.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# engines in the calling process, one OpenMP thread, no binding (a shared 2-core CPU)
for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

V = 151936
N_TARGET_LAYERS = 36
NUM_FEATURES = 14
DRAFT_LAYERS = 5
BLOCK_SIZE = 8  # counts the anchor: K = 7
SHAPES = {  # hidden, intermediate, rank (docs/dlite_v1.md §7)
    "4B": {"hidden_size": 2560, "intermediate_size": 9728, "sequential_rank": 320},
    "8B": {"hidden_size": 4096, "intermediate_size": 12288, "sequential_rank": 512},
}
EXPECTED_PARAMS = {"4B": 603_322_560, "8B": 1_123_879_680}
TARGET_INTERMEDIATE = 1024
TOKENIZER_VOCAB = 512
INIT_STD, RESIDUAL_SCALE, DRAFTER_STD = 0.25, 0.08, 0.2
PROMPT_LENS = (64, 256, 512, 1000)
MAX_MODEL_LEN = 1100
OUT = REPO / "benchmarks" / "results" / "real-shapes"

_CORPUS = [
    "def read_file(path, start, end):\n    with open(path) as f:\n        return f.readlines()[start:end]\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\nfor name in os.listdir('.'):\n    print(name)\n",
    "{\"name\": \"run\", \"arguments\": {\"cmd\": \"pytest -q\"}}\n",
    "Speculative decoding drafts tokens and the target verifies them in one forward pass.\n",
]


# =========================================================================== models
def target_config(size: str = "4B", intermediate_size: int = TARGET_INTERMEDIATE, **extra) -> dict:
    """Qwen3-{4B,8B}'s config.json (as on the hub), with ``intermediate_size`` replaced."""
    H = SHAPES[size]["hidden_size"]
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H,
           "intermediate_size": intermediate_size, "num_hidden_layers": N_TARGET_LAYERS,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
           "max_position_embeddings": 40960, "attention_bias": False, "attention_dropout": 0.0,
           "use_sliding_window": False, "sliding_window": None, "max_window_layers": N_TARGET_LAYERS,
           "tie_word_embeddings": size == "4B", "vocab_size": V, "initializer_range": 0.02,
           "use_cache": True, "bos_token_id": None, "torch_dtype": "bfloat16",
           "_name_or_path": f"Qwen/Qwen3-{size} (random weights)"}
    cfg.update(extra)
    return cfg


def _save_shards(directory: Path, tensors_by_shard: list[dict], prefix: str = "model") -> None:
    """Write ``tensors_by_shard`` as ``model-0000i-of-0000n.safetensors`` + the index."""
    from safetensors.torch import save_file

    n = len(tensors_by_shard)
    index = {"metadata": {"total_size": 0}, "weight_map": {}}
    for i, tensors in enumerate(tensors_by_shard):
        fname = f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
        index["weight_map"].update({k: fname for k in tensors})
    (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def shard_checkpoint(directory: Path, shards: int = 3) -> list[Path]:
    """Split ``directory/model.safetensors`` into ``shards`` files + model.safetensors.index.json
    (tensors in file order, ~equal bytes per shard), as a hub checkpoint is; removes the single file."""
    from safetensors import safe_open

    directory = Path(directory)
    single = directory / "model.safetensors"
    with safe_open(str(single), "pt") as f:
        names = list(f.keys())
        sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in names}
        total, groups, acc = sum(sizes.values()), [[] for _ in range(shards)], 0
        for k in names:
            groups[min(shards - 1, int(acc * shards / total))].append(k)
            acc += sizes[k]
        parts = [{k: f.get_tensor(k) for k in g} for g in groups if g]
    _save_shards(directory, parts)
    single.unlink()
    return sorted(directory.glob("model-*.safetensors"))


def write_tokenizer(directory: Path) -> int:
    """The project's byte-level BPE (``lab.target.tokenizer``, ``TOKENIZER_VOCAB`` ids) into
    ``directory``; returns the ``<|mask|>`` id."""
    from lab.target.tokenizer import MASK_TOKEN, train_tokenizer

    tok = train_tokenizer(_CORPUS * 4, vocab_size=TOKENIZER_VOCAB)
    tok.save_pretrained(str(directory))
    return tok.convert_tokens_to_ids(MASK_TOKEN)


def write_target(directory: Path, size: str = "4B", intermediate_size: int = TARGET_INTERMEDIATE,
                 seed: int = 0, layers_per_shard: int = 9) -> Path:
    """Random-weight Qwen3 target with ``size``'s config (see the module docstring), bf16 shards +
    index + tokenizer. Tensors are drawn in fp32 one at a time (peak ~1.6 GB: the embedding)."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = target_config(size, intermediate_size)
    H, I, D = cfg["hidden_size"], intermediate_size, cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * (INIT_STD * scale)).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    shards = [{"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": ones(H)}]
    if not cfg["tie_word_embeddings"]:
        shards[0]["lm_head.weight"] = rnd(V, H)
    for i in range(cfg["num_hidden_layers"]):
        if i % layers_per_shard == 0:
            shards.append({})
        p = f"model.layers.{i}."
        shards[-1].update({
            p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
            p + "self_attn.q_proj.weight": rnd(q, H), p + "self_attn.k_proj.weight": rnd(kv, H),
            p + "self_attn.v_proj.weight": rnd(kv, H),
            p + "self_attn.o_proj.weight": rnd(H, q, scale=RESIDUAL_SCALE),
            p + "self_attn.q_norm.weight": ones(D), p + "self_attn.k_norm.weight": ones(D),
            p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
            p + "mlp.down_proj.weight": rnd(H, I, scale=RESIDUAL_SCALE),
        })
    _save_shards(directory, shards)
    del shards
    mask = write_tokenizer(directory)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    cfg.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (directory / "mask_token_id").write_text(f"{mask}\n")
    return directory


def drafter_config(target_cfg: dict, size: str, mask_token_id: int):
    from vllm_dlite.config import DLiteConfig

    s = SHAPES[size]
    return DLiteConfig.for_target(target_cfg, num_feature_layers=NUM_FEATURES, mask_token_id=mask_token_id,
                                  num_hidden_layers=DRAFT_LAYERS, block_size=BLOCK_SIZE, anchor_group_size=1,
                                  intermediate_size=s["intermediate_size"],
                                  sequential_rank=s["sequential_rank"])


def write_drafter(directory: Path, target_cfg: dict, size: str, mask_token_id: int, seed: int = 1,
                  shards: int = 3) -> dict:
    """Random DLite drafter in the authors' layout at ``size``'s shapes (module docstring), bf16,
    ``shards`` shards + index. Returns ``{params, checksums}`` (checksums: tensor -> float64 sum of
    its bf16 values, to check a load against)."""
    import torch

    from vllm_dlite.model import DLiteDrafter, save_pretrained

    torch.manual_seed(seed)
    drafter = DLiteDrafter(drafter_config(target_cfg, size, mask_token_id))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, DRAFTER_STD)
    params = sum(p.numel() for p in drafter.parameters())
    checksums = {k: float(v.detach().to(torch.bfloat16).double().sum()) for k, v in drafter.state_dict().items()}
    save_pretrained(drafter, directory, target_cfg, dtype=torch.bfloat16)
    del drafter
    shard_checkpoint(Path(directory), shards)
    return {"params": params, "checksums": checksums}


def build_4b(root: Path, target_intermediate: int = TARGET_INTERMEDIATE) -> dict:
    """Target + drafter at Qwen3-4B shapes under ``root`` (reused when already there)."""
    root = Path(root)
    target, drafter = root / "target-4b", root / "dlite-4b"
    t0 = time.perf_counter()
    reused = (target / "config.json").exists() and (drafter / "config.json").exists()
    if not (target / "config.json").exists():
        write_target(target, "4B", target_intermediate)
    mask = int((target / "mask_token_id").read_text())
    info = {}
    if not (drafter / "config.json").exists():
        info = write_drafter(drafter, json.loads((target / "config.json").read_text()), "4B", mask)
        if info["params"] != EXPECTED_PARAMS["4B"]:
            raise AssertionError(f"4B drafter has {info['params']} parameters, expected {EXPECTED_PARAMS['4B']}")
    return {"target": str(target), "drafter": str(drafter), "mask_token_id": mask,
            "drafter_params": info.get("params", EXPECTED_PARAMS["4B"]),
            "build_s": round(time.perf_counter() - t0, 1), "reused": reused,
            "target_files": sorted(p.name for p in target.glob("*.safetensors*")),
            "drafter_files": sorted(p.name for p in drafter.glob("*.safetensors*"))}


def make_prompts(lengths=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    """Random token ids over the whole vocabulary, one prompt per length."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(V) for _ in range(n)] for n in lengths]


# =========================================================================== serving
def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _serve_here(target: str, drafter, prompts: list[list[int]], opts: dict) -> dict:
    """One engine in this process (set up for its runner by ``call_with_runner``): the batch, then
    the first prompt alone for the timings."""
    import gc

    import torch

    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lab.harness.runners import runner_of
    from vllm_dlite.vllm.draft_model import DFlashDLiteDraftModel
    from vllm_dlite.vllm.plugin import register

    register()
    rounds: list[tuple[int, int, float]] = []  # (batch, k, seconds) per propose_drafts call
    original = DFlashDLiteDraftModel.propose_drafts

    def timed(self, features, group_ids, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, features, group_ids, *args, **kwargs)
        rounds.append((int(group_ids.shape[0]), int(out[0].shape[1]), time.perf_counter() - start))
        return out

    DFlashDLiteDraftModel.propose_drafts = timed
    spec = None if drafter is None else {"method": "dlite", "model": str(drafter)}
    t0 = time.perf_counter()
    llm = LLM(model=target, dtype=opts["dtype"], max_model_len=opts["max_model_len"], max_num_seqs=4,
              seed=0, enforce_eager=True, enable_prefix_caching=False, disable_log_stats=False,
              speculative_config=spec)
    load_s = time.perf_counter() - t0
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=opts["max_tokens"], ignore_eos=True, detokenize=False)
        rounds.clear()
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
        batch_s = time.perf_counter() - t0
        batch_rounds = list(rounds)
        metrics = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode") and hasattr(m, "value"):
                metrics[m.name] = m.value
        # batch 1: the first prompt alone
        timing = SamplingParams(temperature=0.0, max_tokens=opts["timing_tokens"], ignore_eos=True,
                                detokenize=False)
        rounds.clear()
        (one,) = llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], timing, use_tqdm=False)
        st = one.metrics
        n_tok = len(one.outputs[0].token_ids)
        decode_window = st.last_token_ts - st.first_token_ts
        solo_rounds = [r for r in rounds if r[0] == 1]
        result = {
            "runner": runner_of(llm),
            "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "timing_output": list(one.outputs[0].token_ids),
            "load_s": round(load_s, 1), "batch_s": round(batch_s, 1),
            "spec_metrics": metrics,
            "timing": {
                "prompt_tokens": len(prompts[0]), "new_tokens": n_tok,
                "ttft_s": round(st.first_token_ts - st.scheduled_ts, 3),
                "inter_token_ms": round(1000 * decode_window / max(1, n_tok - 1), 1),
                # DLite: rounds after the first token (the first one follows the prefill)
                "step_ms": (round(1000 * decode_window / max(1, len(solo_rounds) - 1), 1)
                            if len(solo_rounds) > 1 else None),
                "draft_round_ms": ([round(1000 * s, 1) for _, _, s in solo_rounds]),
            },
            "batch_draft_round_ms": {str(b): round(1000 * statistics.median(s for bb, _, s in batch_rounds if bb == b), 1)
                                     for b in sorted({r[0] for r in batch_rounds})},
            "batch_draft_rounds": len(batch_rounds),
            "draft_k": sorted({r[1] for r in batch_rounds}),
        }
    finally:
        DFlashDLiteDraftModel.propose_drafts = original
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
        del llm
        gc.collect()
    result["peak_rss_gib"] = round(_peak_rss_gib(), 2)
    return result


def serve(runner: str, target: str, drafter, prompts: list[list[int]], *, dtype: str = "float32",
          max_tokens: int = 32, timing_tokens: int = 24, kv_gib: float = 2,
          max_model_len: int = MAX_MODEL_LEN) -> dict:
    """One engine (``drafter`` None: no speculation) in a fresh process set up for ``runner``."""
    from lab.harness.runners import call_with_runner

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_gib:g}"
    opts = dict(dtype=dtype, max_tokens=max_tokens, timing_tokens=timing_tokens, max_model_len=max_model_len)
    t0 = time.perf_counter()
    out = call_with_runner(runner, "real_shapes:_serve_here", str(target), None if drafter is None else str(drafter),
                           prompts, opts)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def check_runner(runner: str, models: dict, prompts: list[list[int]], **kw) -> dict:
    """No speculation and DLite on ``runner``: identical outputs, equal KV pools, CPU timings."""
    base = serve(runner, models["target"], None, prompts, **kw)
    dlite = serve(runner, models["target"], models["drafter"], prompts, **kw)
    identical = [a == b for a, b in zip(base["outputs"], dlite["outputs"])]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(base["outputs"], dlite["outputs"])]
    rounds = dlite["timing"]["draft_round_ms"]
    summary = {
        "runner": runner, "runners_used": [base["runner"], dlite["runner"]],
        "identical": sum(identical), "prompts": len(prompts), "first_difference": first_diff,
        "timing_identical": base["timing_output"] == dlite["timing_output"],
        "distinct_output_tokens": len({t for o in base["outputs"] for t in o}),
        "kv_blocks": {"none": base["num_gpu_blocks"], "dlite": dlite["num_gpu_blocks"]},
        "kv_tokens": {"none": base["num_gpu_blocks"] * base["block_size"],
                      "dlite": dlite["num_gpu_blocks"] * dlite["block_size"]},
        "kv_equal": base["num_gpu_blocks"] == dlite["num_gpu_blocks"],
        "decode_step_ms": base["timing"]["inter_token_ms"],
        "draft_round_ms": round(statistics.median(rounds[1:] or rounds), 1) if rounds else None,
        "dlite_step_ms": dlite["timing"]["step_ms"],
        "peak_rss_gib": {"none": base["peak_rss_gib"], "dlite": dlite["peak_rss_gib"]},
        "wall_s": {"none": base["wall_s"], "dlite": dlite["wall_s"]},
        "accepted": dlite["spec_metrics"],
    }
    summary["ok"] = summary["identical"] == len(prompts) and summary["kv_equal"] and summary["timing_identical"]
    return {"summary": summary, "none": base, "dlite": dlite}


# =========================================================================== Qwen3-8B, no serving
def validate_8b(root: str) -> dict:
    """8B-shape drafter: save (bf16, 3 shards + index), config-time check, load, checksums, bind, one
    round. Run it in a fresh process (:func:`lab.harness.processes.in_fresh_process`)."""
    import torch

    torch.set_num_threads(1)
    from vllm_dlite.model import load_drafter
    from vllm_dlite.vllm.plugin import prepare_speculative_config

    directory = Path(root) / "dlite-8b"
    tcfg = target_config("8B", SHAPES["8B"]["intermediate_size"])
    mask = 151669  # a reserved id of the Qwen3 tokenizer
    out: dict = {}
    t0 = time.perf_counter()
    info = write_drafter(directory, tcfg, "8B", mask)
    out["save_s"] = round(time.perf_counter() - t0, 1)
    out["params"] = info["params"]
    out["params_ok"] = info["params"] == EXPECTED_PARAMS["8B"]
    out["files"] = sorted(p.name for p in directory.glob("*.safetensors*"))
    t0 = time.perf_counter()
    spec = prepare_speculative_config({"method": "dlite", "model": str(directory)}, tcfg)
    out["config_check_s"] = round(time.perf_counter() - t0, 2)
    out["config_check"] = {k: spec[k] for k in ("method", "num_speculative_tokens")}
    t0 = time.perf_counter()
    drafter = load_drafter(directory, dtype=torch.float32)
    out["load_s"] = round(time.perf_counter() - t0, 1)
    bad = [k for k, v in drafter.state_dict().items()
           if float(v.to(torch.bfloat16).double().sum()) != info["checksums"][k]]
    out["tensors"] = len(info["checksums"])
    out["checksum_mismatches"] = bad
    gen = torch.Generator().manual_seed(0)
    H = SHAPES["8B"]["hidden_size"]
    embed = torch.randn(V, H, generator=gen) * INIT_STD
    drafter.bind_target(embed, torch.ones(H), 1e-6)
    features = torch.randn(1, NUM_FEATURES, H, generator=gen)
    with torch.inference_mode():
        drafter.draft(features, torch.tensor([[mask - 1]]))  # warm-up
        t0 = time.perf_counter()
        res = drafter.draft(features, torch.tensor([[12345]]))
        out["draft_round_ms"] = round(1000 * (time.perf_counter() - t0), 1)
    out["draft_ids"] = res.token_ids.tolist()
    out["finite"] = bool(torch.isfinite(res.logits).all()) if res.logits is not None else None
    out["ok"] = out["params_ok"] and not bad and res.token_ids.shape == (1, BLOCK_SIZE - 1)
    out["peak_rss_gib"] = round(_peak_rss_gib(), 2)
    return out


# =========================================================================== report
def render(results: dict) -> str:
    lines = ["# Real shapes on this CPU (issue 36)", "",
             f"Command: `{results['command']}`; total {results['total_s']:.0f} s. CPU figures (2-core host, one OpenMP "
             "thread, shared), not a GPU's.", "",
             f"Target: random Qwen3-4B config (hidden 2560, 36 layers, 32/8 heads, head_dim 128, vocab 151,936, "
             f"tied), intermediate {results['target_intermediate']} (real: 9728), bf16 shards + index, served "
             f"{results['dtype']}. Drafter: authors' layout at 4B shapes ({results['models']['drafter_params']:,} "
             f"params: 5 layers, intermediate 9728, L = 14, rank 320, K = 7), bf16, "
             f"{len([f for f in results['models']['drafter_files'] if f.endswith('.safetensors')])} shards + index. "
             f"Prompts: {results['prompt_lens']} tokens (random ids), {results['max_tokens']} new tokens each, greedy, "
             f"batch up to 4; KV space {results['kv_gib']} GiB for both engines. Models "
             + ("reused from an earlier run" if results['models'].get('reused') else
                f"built in {results['models']['build_s']} s") + "."
             + "".join(f" Merged: `{m['command']}` ({m['total_s']:.0f} s, {', '.join(m['parts'])})."
                       for m in results.get("merged_from", [])), "",
             "| runner | identical (batch) | identical (solo) | KV blocks none / dlite | decode step ms (no spec, batch 1) "
             "| draft round ms (batch 1) | DLite round ms (draft + verify 8) | peak RSS GiB none / dlite | wall s none / dlite |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r, res in results["runners"].items():
        if "error" in res:
            lines.append(f"| {r} | error: {res['error']} | | | | | | | |")
            continue
        s = res["summary"]
        lines.append(
            f"| {r} | {s['identical']}/{s['prompts']} | {s['timing_identical']} | {s['kv_blocks']['none']} / "
            f"{s['kv_blocks']['dlite']} ({s['kv_tokens']['none']:,} tokens) | {s['decode_step_ms']} | {s['draft_round_ms']} "
            f"| {s['dlite_step_ms']} | {s['peak_rss_gib']['none']} / {s['peak_rss_gib']['dlite']} "
            f"| {s['wall_s']['none']} / {s['wall_s']['dlite']} |")
    e = results.get("8B")
    if e:
        lines += ["", "Qwen3-8B shapes (no serving): " + (
            f"error: {e['error']}" if "error" in e else
            f"{e['params']:,} params ({'as expected' if e['params_ok'] else 'UNEXPECTED'}), saved bf16 as {e['files']} "
            f"in {e['save_s']} s; prepare_speculative_config against Qwen3-8B's config in {e['config_check_s']} s "
            f"({e['config_check']}); load_drafter (fp32) in {e['load_s']} s, {e['tensors']} tensors, checksum "
            f"mismatches: {len(e['checksum_mismatches'])}; one greedy round (batch 1) {e['draft_round_ms']} ms; "
            f"peak RSS {e['peak_rss_gib']} GiB.")]
    lines += ["", "Timings: decode step = the no-speculation engine's inter-token latency for the first prompt "
              "alone (vLLM's per-request timestamps); draft round = median wall time of "
              "`DFlashDLiteDraftModel.propose_drafts` at batch 1, wrapped in-process; DLite round = the DLite "
              "engine's time per round for the same request. See results.json for every figure.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/dlite-real-shapes"),
                    help="where the models are written (reused when present)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--runners", nargs="*", default=["v1", "v2"], choices=["v1", "v2"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=list(PROMPT_LENS))
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timing-tokens", type=int, default=24)
    ap.add_argument("--kv-gib", type=float, default=2)
    ap.add_argument("--target-intermediate", type=int, default=TARGET_INTERMEDIATE)
    ap.add_argument("--no-8b", action="store_true", help="skip the Qwen3-8B load + validation")
    ap.add_argument("--merge", type=Path, nargs="*", default=[],
                    help="earlier results.json files: their runners / 8B check not run now are copied in "
                         "(same settings required), their command recorded under merged_from")
    args = ap.parse_args(argv)
    if max(args.prompt_lens) + args.max_tokens > MAX_MODEL_LEN:
        ap.error(f"prompt + new tokens must fit max_model_len {MAX_MODEL_LEN}")

    from lab.harness.processes import in_fresh_process

    start = time.perf_counter()
    results: dict = {"command": "python benchmarks/real_shapes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "dtype": args.dtype, "prompt_lens": args.prompt_lens, "max_tokens": args.max_tokens,
                     "timing_tokens": args.timing_tokens, "kv_gib": args.kv_gib,
                     "target_intermediate": args.target_intermediate, "runners": {}}
    results["models"] = in_fresh_process(build_4b, str(args.root), args.target_intermediate)
    print(f"models: {results['models']}", flush=True)
    prompts = make_prompts(args.prompt_lens)
    kw = dict(dtype=args.dtype, max_tokens=args.max_tokens, timing_tokens=args.timing_tokens, kv_gib=args.kv_gib)
    for runner in args.runners:
        try:
            res = check_runner(runner, results["models"], prompts, **kw)
        except Exception as exc:  # noqa: BLE001 - recorded, and the exit status says so
            res = {"error": f"{type(exc).__name__}: {exc}"}
        results["runners"][runner] = res
        print(f"{runner}: {res.get('summary', res)}", flush=True)
    if not args.no_8b:
        try:
            results["8B"] = in_fresh_process(validate_8b, str(args.root))
        except Exception as exc:  # noqa: BLE001
            results["8B"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"8B: {results['8B']}", flush=True)
    results["total_s"] = round(time.perf_counter() - start, 1)
    for path in args.merge:
        earlier = json.loads(Path(path).read_text())
        same = ("dtype", "prompt_lens", "max_tokens", "timing_tokens", "kv_gib", "target_intermediate")
        if any(earlier[k] != results[k] for k in same):
            ap.error(f"{path} was run with other settings ({ {k: earlier[k] for k in same} })")
        parts = [r for r in earlier["runners"] if r not in results["runners"]]
        results["runners"].update({r: earlier["runners"][r] for r in parts})
        if "8B" in earlier and "8B" not in results:
            results["8B"] = earlier["8B"]
            parts.append("8B")
        results.setdefault("merged_from", []).append(
            {"command": earlier["command"], "total_s": earlier["total_s"], "parts": parts})
        if not earlier["models"].get("reused"):
            results["models"]["build_s"], results["models"]["reused"] = earlier["models"]["build_s"], False
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(render(results))
    ok = all(r.get("summary", {}).get("ok") for r in results["runners"].values())
    ok = ok and ("8B" not in results or bool(results["8B"].get("ok")))
    print(f"{'OK' if ok else 'FAILED'} in {results['total_s']:.0f} s; wrote {args.out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
