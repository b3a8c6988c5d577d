"""Fixtures for the vLLM integration tests: tiny random-weight Qwen3 targets and DLite drafters.

Everything here is small enough for a 2-core CPU:

* :func:`make_tiny_target` writes an HF ``Qwen3ForCausalLM`` directory (random weights, fp32,
  byte-level BPE tokenizer with the project's special tokens, ``<|mask|>`` included). The init
  scale is larger than HF's default so greedy argmaxes are decisive (no near-ties that numeric
  noise between batch shapes could flip).
* :func:`make_random_drafter` writes a random dlite_v1 checkpoint in the authors' layout
  (``vllm_dlite.model.save_pretrained``).
* :func:`make_copy_drafter` writes a dlite_v1 checkpoint that drafts ``[x_a, x_a, ..., x_a]`` (the
  anchor repeated) for a tied-embedding target, through the sequential head alone.
  Random targets fall into repetition loops under greedy decoding, so this drafter gets real
  acceptances (exercises the accept/bookkeeping path, not just rejections).
* :func:`hf_features` computes the features vLLM should serve (aux id i = residual after i decoder
  layers, pre-norm; id N through a hook on the last decoder layer).

Model directories are cached per process under one temp root (see :func:`tiny_models`).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

TARGET_LAYERS = 4
TARGET_HIDDEN = 64
TARGET_VOCAB = 384
BLOCK_K = 4

_CORPUS = [
    "def read_file(path, start, end):\n    with open(path) as f:\n        return f.readlines()[start:end]\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\nfor name in os.listdir('.'):\n    print(name)\n",
    "grep -rn 'TODO' src/ | head -20\n",
    "User asked to list the directory; the assistant calls list_dir with path '.'.\n",
    "{\"name\": \"run\", \"arguments\": {\"cmd\": \"pytest -q\"}}\n",
    "Speculative decoding drafts tokens and the target verifies them in one forward pass.\n",
    "class Config:\n    def __init__(self, size=64):\n        self.size = size\n",
]

PROMPTS = [
    "def read_file(path",
    "The quick brown",
    "import os\n",
    "grep -rn",
    "User asked to",
    "{\"name\": \"run\"",
    "Speculative decoding",
    "class Config:",
    "for name in",
    "print(name)",
    "the lazy dog",
    "with open(path) as f",
    "pytest -q",
    "self.size = size",
    "The assistant calls",
    "return f.readlines()",
]


def make_prompts(n: int) -> list[str]:
    """``n`` distinct short prompts (cycled base prompts with a numbered suffix)."""
    return [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]


def _build_tokenizer(vocab_size: int):
    from lab.target.tokenizer import train_tokenizer

    return train_tokenizer(_CORPUS * 4, vocab_size=vocab_size)


def make_tiny_target(
    directory: Path,
    *,
    num_layers: int = TARGET_LAYERS,
    hidden_size: int = TARGET_HIDDEN,
    vocab_size: int = TARGET_VOCAB,
    tie_word_embeddings: bool = True,
    init_std: float = 0.25,
    residual_scale: float = 0.08,
    seed: int = 0,
) -> Path:
    """Write a random-weight tiny Qwen3 (fp32) + tokenizer into ``directory``.

    ``residual_scale`` shrinks every layer's ``o_proj`` and ``down_proj``: with tied embeddings
    the token's own embedding then dominates the logits often enough that greedy decoding falls
    into runs of a repeated token (so the copy drafter gets a mix of accepted and rejected
    drafts), while the layers still shape the rest of the output.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(vocab_size)
    assert len(tok) <= vocab_size, (len(tok), vocab_size)
    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,  # vLLM's CPU attention supports head_dim 32, not 16
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        initializer_range=init_std,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    # vLLM reads the dtype from config.json
    cfg_path = directory / "config.json"
    data = json.loads(cfg_path.read_text())
    data["torch_dtype"] = "float32"
    data.pop("dtype", None)
    cfg_path.write_text(json.dumps(data, indent=2))
    return directory


def target_config(target_dir: Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def mask_token_id(target_dir: Path) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir)).convert_tokens_to_ids("<|mask|>")


def _dlite_config(target_dir: Path, **overrides):
    from vllm_dlite.config import DLiteConfig

    t = target_config(target_dir)
    values = dict(
        num_feature_layers=min(4, t["num_hidden_layers"]),
        mask_token_id=mask_token_id(target_dir),
        block_size=BLOCK_K + 1,  # counts the anchor: K = BLOCK_K drafts
        num_hidden_layers=1,
        sequential_rank=8,
    )
    values.update(overrides)
    return DLiteConfig.for_target(t, **values)


def make_random_drafter(
    directory: Path, target_dir: Path, *, seed: int = 1, std: float = 0.2, **overrides
) -> Path:
    """Random dlite_v1 checkpoint for ``target_dir`` (authors' layout, fp32 on disk)."""
    from vllm_dlite.model import DLiteDrafter, save_pretrained

    torch.manual_seed(seed)
    drafter = DLiteDrafter(_dlite_config(target_dir, **overrides))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    save_pretrained(drafter, directory, target_config(target_dir), dtype=torch.float32)
    return Path(directory)


def make_copy_drafter(directory: Path, target_dir: Path, *, gain: float = 0.3, **overrides) -> Path:
    """dlite_v1 checkpoint drafting ``[x_a, x_a, ...]`` (needs a tied-embedding target): the
    head's gate is shut (``s = tanh(c)``), ``c = P[t]`` with ``P = gain * E`` (rank r = H),
    the readout passes the state through and ``W_o = E``, so ``logits ~ gain * E E[t]``, whose
    argmax is ``t`` for the random target's embedding."""
    from safetensors.torch import load_file

    from vllm_dlite.model import DLiteDrafter, save_pretrained

    t = target_config(target_dir)
    assert t.get("tie_word_embeddings"), "the copy drafter needs lm_head == embed_tokens"
    H = t["hidden_size"]
    weights = load_file(str(Path(target_dir) / "model.safetensors"))
    E = weights["model.embed_tokens.weight"].float()  # [V, H]
    drafter = DLiteDrafter(_dlite_config(target_dir, sequential_rank=H, **overrides))
    head = drafter.sequential_head
    with torch.no_grad():
        head.prev_token_embedding.weight.copy_(gain * E[: drafter.config.vocab_size])
        head.state_proj.weight.zero_()
        head.state_proj.weight[H:, H:].copy_(torch.eye(H))  # c = e
        head.state_proj.bias.zero_()
        head.state_proj.bias[:H].fill_(-30.0)  # gate z -> sigmoid 0: s = tanh(c)
        head.state_hidden_mlp.weight.zero_()
        head.state_hidden_mlp.weight[:, :H].copy_(torch.eye(H))  # o = s
        head.state_hidden_mlp.bias.zero_()
        head.output_proj.weight.copy_(E[: drafter.config.vocab_size])
    save_pretrained(drafter, directory, t, dtype=torch.float32)
    return Path(directory)


@dataclass
class TinyModels:
    root: Path
    target: Path
    drafter: Path  # random drafter
    copy_drafter: Path


_CACHE: dict[str, TinyModels] = {}


def tiny_models(root: Optional[Path] = None) -> TinyModels:
    """Build (once per process) a tiny target, a random drafter and a copy drafter."""
    key = str(root)
    if key in _CACHE:
        return _CACHE[key]
    root = Path(root or tempfile.mkdtemp(prefix="dlite-vllm-"))
    models = TinyModels(root, root / "target", root / "drafter", root / "copy_drafter")
    if not (models.target / "config.json").exists():  # an existing root is reused as is
        make_tiny_target(models.target)
    if not (models.drafter / "config.json").exists():
        make_random_drafter(models.drafter, models.target)
    if not (models.copy_drafter / "config.json").exists():
        make_copy_drafter(models.copy_drafter, models.target)
    _CACHE[key] = models
    return models


@functools.lru_cache(maxsize=4)
def _hf_model(target_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_features(target_dir: Path, token_ids: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Target features ``[T, L, H]`` fp32 with vLLM's aux convention, computed with HF.

    id i < N: ``output_hidden_states[i]`` (residual after i layers); id N: the last decoder
    layer's output captured by a forward hook (pre final norm; HF's last hidden state is
    post-norm).
    """
    model = _hf_model(str(target_dir))
    n = model.config.num_hidden_layers
    captured = {}
    handle = model.model.layers[n - 1].register_forward_hook(
        lambda mod, inp, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        handle.remove()
    rows = []
    for i in layer_ids:
        rows.append(captured["last"][0] if i == n else out.hidden_states[i][0])
    return torch.stack(rows, dim=1).float()




def vllm_env() -> dict[str, str]:
    """Environment for small in-process vLLM runs on CPU (one OpenMP thread: on a shared
    2-core machine two spinning OpenMP threads make every tiny matmul ~100x slower)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def apply_vllm_env() -> None:
    for k, v in vllm_env().items():
        os.environ.setdefault(k, v)


def read_metrics(llm) -> dict[str, object]:
    """vLLM's metrics of an ``LLM``: name -> value (Counter/Gauge) or list (Vector)."""
    metrics: dict[str, object] = {}
    for m in llm.get_metrics():
        if hasattr(m, "values"):  # Vector
            metrics[m.name] = list(m.values)
        elif hasattr(m, "value"):  # Counter / Gauge
            metrics[m.name] = m.value
    return metrics


@dataclass
class RunResult:
    token_ids: list[list[int]]
    metrics: dict[str, object]  # metric name -> value (Counter/Gauge) or list (Vector)
    num_gpu_blocks: int
    drafter_types: list[str]
    records: list[dict]  # one per DLite drafting call (features, anchors, drafts, temperatures)
    runner: str = "v1"  # the model runner the engine's workers used ("v1" / "v2")


def run_llm(
    target: Path,
    prompts: list,
    sampling_params,
    speculative_config: Optional[dict] = None,
    record: bool = False,
    runner: str = "v1",
    **llm_kwargs,
) -> RunResult:
    """One ``LLM`` run (fp32, eager, small KV pool, engine in the calling process); returns outputs
    and metrics.

    ``runner="v1"`` runs in this process (which must not have Model Runner V2 set up);
    ``runner="v2"`` runs in a process set up by :mod:`lab.harness.runners` (Model Runner V2
    through Triton's interpreter on CPU; one such process serves every V2 run of the test session),
    unless this process already is one.
    ``record=True`` wraps ``DFlashDLiteDraftModel.propose_drafts`` to keep every drafting call's
    inputs and outputs.
    """
    import gc

    from lab.harness.runners import call_with_runner, current_runner, runner_of

    if runner != current_runner():
        if runner == "v1":
            raise RuntimeError("run_llm(runner='v1') in a process set up for Model Runner V2")
        return call_with_runner(runner, "helpers_vllm:run_llm", target, prompts, sampling_params,
                                speculative_config, record, runner, fresh=False, **llm_kwargs)
    apply_vllm_env()
    torch.set_num_threads(1)
    from vllm import LLM

    from vllm_dlite.vllm.draft_model import DFlashDLiteDraftModel
    from vllm_dlite.vllm.plugin import register

    register()
    records: list[dict] = []
    original = DFlashDLiteDraftModel.propose_drafts
    if record:

        def recording(self, features, group_ids, group_lens=None, temperatures=None, k=None,
                      return_logits=False):
            ids, logits = original(self, features, group_ids, group_lens, temperatures, k,
                                   return_logits)
            records.append(
                {
                    "features": features.detach().float().cpu().clone(),
                    "group_ids": group_ids.detach().long().cpu().clone(),
                    "group_lens": None if group_lens is None else group_lens.detach().cpu().clone(),
                    "anchors": group_ids[:, -1].detach().long().cpu().clone(),
                    "drafts": ids.detach().cpu().clone(),
                    "temperatures": None if temperatures is None else temperatures.detach().float().cpu().clone(),
                    "logits": None if logits is None else logits.detach().cpu().clone(),
                }
            )
            return ids, logits

        DFlashDLiteDraftModel.propose_drafts = recording
    kwargs = dict(
        model=str(target),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,
    )
    kwargs.update(llm_kwargs)
    if speculative_config is not None:
        kwargs["speculative_config"] = dict(speculative_config)
    llm = None
    try:
        llm = LLM(**kwargs)
        outs = llm.generate(prompts, sampling_params, use_tqdm=False)
        metrics = read_metrics(llm)
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        drafter_types = llm.collective_rpc(
            lambda worker: type(getattr(worker.model_runner, "drafter", None)  # V1
                                or getattr(worker.model_runner, "speculator", None)).__name__  # V2
        )
        return RunResult(
            [list(o.outputs[0].token_ids) for o in outs], metrics, blocks, drafter_types, records,
            runner_of(llm),
        )
    finally:
        DFlashDLiteDraftModel.propose_drafts = original
        del llm
        gc.collect()
