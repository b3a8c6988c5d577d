"""The authors' Qwen3-4B / Qwen3-8B drafter layouts at their real shapes, at vLLM's config time
(issue 36, deliverable 3): no engine and no weights, only config.json and safetensors headers.

A checkpoint here is what ``SJTU-DAI-Sys/Qwen3-{4B,8B}-DLite`` is described to be (docs/dlite_v1.md
§§1, 7): hidden 2560 / 4096, vocabulary 151,936, N = 36 target layers, L = 14 features, rank 320 /
512, 5 draft layers, bf16, sharded with a ``model.safetensors.index.json``. Each shard is a real
safetensors file whose data region is a hole (sparse), because
:func:`vllm_dlite.model.checkpoint.check_checkpoint` reads names, shapes and dtypes only.

``prepare_speculative_config(spec, target_config_dict)`` must accept the right pairs and refuse,
with one message naming the fix: a drafter for a different target (layer count, vocabulary,
hidden size), a missing shard, a wrong ``mask_token_id``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from vllm_dlite.config import DLiteConfig, build_target_layer_ids
from vllm_dlite.model import DLiteDrafter
from vllm_dlite.vllm.plugin import prepare_speculative_config
from sparse_safetensors import write_sparse_safetensors

V = 151936
SHAPES = {  # hidden, intermediate, rank (docs/dlite_v1.md §7; L = 14 as the issue states)
    "4B": (2560, 9728, 320),
    "8B": (4096, 12288, 512),
}
TARGETS = {  # the Qwen3 targets' config.json sizes
    "4B": {"_name_or_path": "Qwen/Qwen3-4B", "hidden_size": 2560, "num_hidden_layers": 36, "vocab_size": V},
    "8B": {"_name_or_path": "Qwen/Qwen3-8B", "hidden_size": 4096, "num_hidden_layers": 36, "vocab_size": V},
}
MASK = 151669  # a reserved token of the Qwen3 tokenizer


def authors_config(size: str, *, num_target_layers: int = 36, L: int = 14) -> dict:
    H, I, r = SHAPES[size]
    return {"architectures": ["DLiteDraftModel"], "model_type": "qwen3", "hidden_size": H,
            "intermediate_size": I, "num_hidden_layers": 5, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "max_position_embeddings": 40960, "attention_bias": False,
            "use_sliding_window": False, "vocab_size": V, "num_target_layers": num_target_layers,
            "block_size": 8, "torch_dtype": "bfloat16",
            "dlite_config": {"architecture_version": "dlite_v1", "model_role": "pivot_q_student",
                             "anchor_group_size": 1, "chs_num_layers": L,
                             "target_layer_ids": build_target_layer_ids(num_target_layers, L),
                             "sequential_head": "rnn", "sequential_rank": r, "mask_token_id": MASK}}


def write_checkpoint(directory: Path, cfg: dict, shards: int = 3) -> Path:
    """config.json + ``shards`` sparse bf16 shards + model.safetensors.index.json, in the
    authors' tensor names, with the shapes the config implies (built on the meta device)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    with torch.device("meta"):
        model = DLiteDrafter(DLiteConfig.from_checkpoint_config(cfg))
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names = list(state)
    index = {"metadata": {"total_size": 2 * sum(math.prod(s) for s in state.values())}, "weight_map": {}}
    per = math.ceil(len(names) / shards)
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[s * per:(s + 1) * per]
        write_sparse_safetensors(directory / fname, {n: state[n] for n in chunk})
        index["weight_map"].update({n: fname for n in chunk})
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real_shapes")
    return {size: write_checkpoint(root / size, authors_config(size)) for size in SHAPES}


def _refusal(model: Path, target: dict) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        prepare_speculative_config({"method": "dlite", "model": str(model)}, target)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("size", list(SHAPES))
def test_the_authors_layout_passes_at_config_time_quickly(checkpoints, size):
    start = time.perf_counter()
    out = prepare_speculative_config({"method": "dlite", "model": str(checkpoints[size])}, TARGETS[size])
    assert time.perf_counter() - start < 30  # headers only: no tensor data is read
    assert out["method"] == "dflash" and out["num_speculative_tokens"] == 7
    assert out["model"] == str(checkpoints[size])
    assert sum(f.stat().st_blocks for f in checkpoints[size].glob("*.safetensors")) * 512 < 2**20  # sparse


@pytest.mark.parametrize("drafter, target", [("4B", "8B"), ("8B", "4B")])
def test_a_drafter_for_another_hidden_size(checkpoints, drafter, target):
    H, other = SHAPES[drafter][0], TARGETS[target]["hidden_size"]
    msg = _refusal(checkpoints[drafter], TARGETS[target])
    assert f"the DLite drafter has hidden_size={H} but target 'Qwen/Qwen3-{target}' has hidden_size={other}" in msg
    assert "use a DLite drafter trained for this target" in msg and str(checkpoints[drafter]) in msg


def test_a_drafter_for_another_layer_count(checkpoints):
    target = dict(TARGETS["4B"], num_hidden_layers=28, _name_or_path="a 28-layer target")
    msg = _refusal(checkpoints["4B"], target)
    assert "trained for num_target_layers=36" in msg and "has 28 layers" in msg
    assert "use a DLite drafter trained for this target" in msg


def test_a_drafter_for_another_vocabulary(checkpoints):
    target = dict(TARGETS["8B"], vocab_size=152064, _name_or_path="Qwen/Qwen2.5-7B-like")
    msg = _refusal(checkpoints["8B"], target)
    assert "vocab_size=151936 but target 'Qwen/Qwen2.5-7B-like' has vocab_size=152064" in msg
    assert "use a DLite drafter trained for this target" in msg


def test_a_missing_shard(tmp_path):
    d = write_checkpoint(tmp_path / "4B-missing", authors_config("4B"))
    (d / "model-00002-of-00003.safetensors").unlink()
    msg = _refusal(d, TARGETS["4B"])
    assert "model.safetensors.index.json maps tensors to 3 shard(s)" in msg
    assert "['model-00002-of-00003.safetensors'] is missing" in msg
    assert "download the checkpoint again" in msg


@pytest.mark.parametrize("mask, needle", [
    (V, "mask_token_id = 151936 is invalid: it must be a token id in 0..151935"),
    (-1, "mask_token_id = -1 is invalid"),
    (None, "config.json has no mask_token_id"),
])
def test_a_wrong_mask_token_id(tmp_path, mask, needle):
    cfg = authors_config("4B")
    if mask is None:
        del cfg["dlite_config"]["mask_token_id"]
    else:
        cfg["dlite_config"]["mask_token_id"] = mask
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))  # refused before any tensor is looked at
    msg = _refusal(d, TARGETS["4B"])
    assert needle in msg and str(d / "config.json") in msg
    assert "use a reserved token of the target's tokenizer" in msg or "add the target tokenizer's mask token id" in msg


def test_layer_ids_off_the_rule_at_real_shapes(tmp_path):
    cfg = authors_config("4B")
    cfg["dlite_config"]["target_layer_ids"] = list(range(14))
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    msg = _refusal(d, TARGETS["4B"])
    assert "set target_layer_ids to [0, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35]" in msg
