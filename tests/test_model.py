"""Tests of the DLite config, reference ops, drafter, loader and teacher (tiny dims, CPU, fast)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from vllm_dlite import ops
from vllm_dlite.config import (
    DLiteConfig,
    make_checkpoint_config,
    select_target_layers,
)
from vllm_dlite.model import (
    CheckpointError,
    DLiteDrafter,
    HistoryTeacher,
    load_drafter,
)

torch.set_num_threads(1)

H, L, K, V, RANK = 64, 3, 4, 97, 8
N_TARGET_LAYERS = 6
TARGET_HF_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": H,
    "num_hidden_layers": N_TARGET_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": V,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def make_config(**overrides) -> DLiteConfig:
    values = dict(
        target_layer_ids=[1, 3, 6],
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_layers=2,
        block_size=K,
        head_rank=RANK,
        mask_token_id=V - 1,
        target_name="tiny-qwen3",
        target_hidden_size=H,
        target_vocab_size=V,
        target_num_layers=N_TARGET_LAYERS,
    )
    values.update(overrides)
    return DLiteConfig(**values)


def target_weights(seed: int = 0, hidden: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, hidden, generator=g)
    lm_head = torch.randn(V + 3, hidden, generator=g) * 0.2  # padded vocab rows, as vLLM's
    return embed, lm_head


def randomise_head(model) -> None:
    """w_out starts at 0 (head == backbone); give it weight so the head's effects are visible."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        model.head.w_in.copy_(torch.randn(model.head.w_in.shape, generator=g) * 0.3)
        model.head.w_state.copy_(torch.randn(model.head.w_state.shape, generator=g) * 0.3)
        model.head.w_out.copy_(torch.randn(model.head.w_out.shape, generator=g) * 0.5)


def make_drafter(seed: int = 0, **overrides) -> DLiteDrafter:
    torch.manual_seed(seed)
    drafter = DLiteDrafter.from_config(make_config(**overrides)).eval()
    randomise_head(drafter)
    drafter.bind_target(*target_weights())
    return drafter


def random_inputs(batch: int, seed: int = 1, hidden: int = H):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, L, hidden, generator=g) * 3.0
    anchors = torch.randint(0, V - 1, (batch,), generator=g)
    return features, anchors


# ============================================================================ config
def test_select_target_layers_rule():
    assert select_target_layers(12, 6) == [1, 3, 5, 8, 10, 12]
    for n, num in [(12, 12), (36, 14), (36, 12), (5, 2), (28, 7), (2, 2)]:
        ids = select_target_layers(n, num)
        assert ids[0] == 1 and ids[-1] == n, (n, num, ids)
        assert len(ids) == num and ids == sorted(set(ids))
    assert select_target_layers(12, 12) == list(range(1, 13))
    assert select_target_layers(12, 1) == [12]
    with pytest.raises(ValueError, match="num_selected"):
        select_target_layers(4, 5)


@pytest.mark.parametrize(
    "overrides, field, hint",
    [
        ({"target_layer_ids": [1, 7]}, "target_layer_ids", "outside 0..6"),
        ({"target_layer_ids": [3, 1]}, "target_layer_ids", "strictly increasing"),
        ({"target_layer_ids": []}, "target_layer_ids", "select_target_layers"),
        ({"head_rank": 0}, "head_rank", "positive integer"),
        ({"block_size": 0}, "block_size", "num_speculative_tokens"),
        ({"hidden_size": 66, "head_dim": None}, "head_dim", "set head_dim explicitly"),
        ({"num_key_value_heads": 3}, "num_key_value_heads", "GQA"),
        ({"feature_mode": "concat"}, "feature_mode", '"sequence"'),
        ({"mask_token_id": V}, "mask_token_id", "0..96"),
        ({"head_dim": 15}, "head_dim", "even"),
    ],
)
def test_config_validation_names_field_and_fix(overrides, field, hint):
    with pytest.raises(ValueError) as info:
        make_config(**overrides).validate()
    message = str(info.value)
    assert f"DLiteConfig.{field}" in message and hint in message
    assert "\n" not in message


def test_config_dict_round_trip_and_unknown_keys():
    cfg = make_config(feature_mode="feature", depth_embedding=False)
    assert DLiteConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match=r"unknown keys \['bogus', 'rank'\]"):
        DLiteConfig.from_dict({**cfg.to_dict(), "bogus": 1, "rank": 3})
    missing = cfg.to_dict()
    del missing["head_rank"]
    with pytest.raises(ValueError, match=r"missing required keys \['head_rank'\]"):
        DLiteConfig.from_dict(missing)


def test_checkpoint_config_fields():
    cfg = make_config()
    ckpt = make_checkpoint_config(cfg, TARGET_HF_CONFIG)
    assert ckpt["architectures"] == ["DFlashDLiteDraftModel"]
    assert ckpt["model_type"] == "qwen3"
    assert ckpt["num_hidden_layers"] == cfg.num_layers
    assert ckpt["vocab_size"] == V and ckpt["mask_token_id"] == V - 1
    assert ckpt["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert ckpt["block_size"] == K and ckpt["head_dim"] == 16
    assert DLiteConfig.from_checkpoint_config(ckpt) == cfg
    with pytest.raises(ValueError, match="not a DLite checkpoint"):
        DLiteConfig.from_checkpoint_config({"architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ValueError, match="target_vocab_size"):
        make_checkpoint_config(cfg, {**TARGET_HF_CONFIG, "vocab_size": 1000})
    default = DLiteConfig.for_target(TARGET_HF_CONFIG, num_feature_layers=3, mask_token_id=5)
    assert default.target_layer_ids == [1, 4, 6] and default.head_rank == H // 8


# ============================================================================ ops
def naive_rope(x: torch.Tensor, position: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate pairs (j, j + D/2) by position * theta^(-2j/D), written out element by element."""
    D = x.shape[-1]
    out = x.clone()
    for j in range(D // 2):
        angle = position * theta ** (-2.0 * j / D)
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[..., j], x[..., j + D // 2]
        out[..., j] = a * c - b * s
        out[..., j + D // 2] = b * c + a * s
    return out


def naive_draft_attention(q, k_feat, v_feat, k_block, v_block, scale):
    B, Kb, Hq, D = q.shape
    Lf, Hkv = k_feat.shape[1], k_feat.shape[2]
    out = torch.zeros(B, Kb, Hq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            keys = [naive_rope(k_feat[b, j, kv].double(), 0) for j in range(Lf)]
            keys += [naive_rope(k_block[b, j, kv].double(), 1 + j) for j in range(Kb)]
            values = [v_feat[b, j, kv].double() for j in range(Lf)]
            values += [v_block[b, j, kv].double() for j in range(Kb)]
            keys, values = torch.stack(keys), torch.stack(values)  # [L+K, D]
            for i in range(Kb):
                query = naive_rope(q[b, i, h].double(), 1 + i)
                weights = torch.softmax(keys @ query * scale, dim=0)
                out[b, i, h] = weights @ values
    return out


@pytest.mark.parametrize("num_feat, hq, hkv", [(3, 4, 2), (1, 4, 4), (2, 6, 1)])
def test_draft_attention_matches_naive_loop(num_feat, hq, hkv):
    g = torch.Generator().manual_seed(0)
    B, D = 2, 8
    q = torch.randn(B, K, hq, D, generator=g)
    k_feat, v_feat = torch.randn(2, B, num_feat, hkv, D, generator=g)
    k_block, v_block = torch.randn(2, B, K, hkv, D, generator=g)
    cos, sin = ops.rope_cos_sin(K + 1, D, 10000.0)
    out = ops.draft_attention(q, k_feat, v_feat, k_block, v_block, cos, sin, D**-0.5)
    assert out.shape == (B, K, hq, D) and out.dtype == torch.float32
    expected = naive_draft_attention(q, k_feat, v_feat, k_block, v_block, D**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    out_bf16 = ops.draft_attention(
        *(x.bfloat16() for x in (q, k_feat, v_feat, k_block, v_block)), cos, sin, D**-0.5
    )
    assert out_bf16.dtype == torch.bfloat16


def test_sequential_head_draft_equals_teacher_forced_on_own_drafts():
    drafter = make_drafter()
    features, anchors = random_inputs(5)
    out = drafter.draft(features, anchors)
    with torch.no_grad():
        forced = drafter.forward_train(features, anchors, out.token_ids)
    torch.testing.assert_close(forced, out.logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.logits.argmax(-1), out.token_ids)


# ============================================================================ drafter
def test_draft_shapes_and_dtypes():
    drafter = make_drafter()
    features, anchors = random_inputs(3)
    out = drafter.draft(features.bfloat16(), anchors)  # features in the target's dtype
    assert out.token_ids.shape == (3, K) and out.token_ids.dtype == torch.int64
    assert out.logits.shape == (3, K, V) and out.logits.dtype == torch.float32
    assert drafter.backbone(features, anchors).shape == (3, K, H)
    hidden = drafter.forward_train(features, anchors, out.token_ids, return_hidden=True)
    assert hidden.shape == (3, K, H)
    g = torch.Generator().manual_seed(7)
    sampled = drafter.draft(features, anchors, temperature=0.8, generator=g)
    g.manual_seed(7)
    again = drafter.draft(features, anchors, temperature=0.8, generator=g)
    assert torch.equal(sampled.token_ids, again.token_ids)
    assert int(sampled.token_ids.max()) < V


def test_draft_depends_only_on_own_features_and_anchor():
    drafter = make_drafter()
    state_before = {k: v.clone() for k, v in drafter.state_dict().items()}
    features, anchors = random_inputs(6)
    alone = drafter.draft(features[2:3], anchors[2:3])
    drafter.draft(*random_inputs(4, seed=9))  # unrelated calls in between
    drafter.forward_train(features, anchors, torch.randint(0, V, (6, K)))
    batched = drafter.draft(features, anchors)
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    shuffled = drafter.draft(features[perm], anchors[perm])
    again = drafter.draft(features[2:3], anchors[2:3])
    assert torch.equal(batched.token_ids[2], alone.token_ids[0])
    assert torch.equal(shuffled.token_ids[1], alone.token_ids[0])
    torch.testing.assert_close(batched.logits[2], alone.logits[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(again.token_ids, alone.token_ids) and torch.equal(again.logits, alone.logits)
    # no state: parameters unchanged, no buffers, nothing cached
    assert all(torch.equal(v, state_before[k]) for k, v in drafter.state_dict().items())
    assert list(drafter.buffers()) == []


def test_sequential_head_is_causal_in_teacher_forced_mode():
    drafter = make_drafter()
    features, anchors = random_inputs(2)
    labels = torch.randint(0, V - 1, (2, K))
    base = drafter.forward_train(features, anchors, labels)
    for j in range(K):
        changed = labels.clone()
        changed[:, j] = (changed[:, j] + 17) % (V - 1)
        logits = drafter.forward_train(features, anchors, changed)
        assert torch.equal(logits[:, : j + 1], base[:, : j + 1]), f"position <= {j} changed"
        if j < K - 1:
            assert not torch.allclose(logits[:, j + 1 :], base[:, j + 1 :]), f"no effect after {j}"


def test_backbone_ignores_forced_tokens_and_zero_head_is_parallel_backbone():
    drafter = make_drafter()
    features, anchors = random_inputs(3)
    h = drafter.backbone(features, anchors)
    with torch.no_grad():
        drafter.head.w_out.zero_()
    a = drafter.forward_train(features, anchors, torch.randint(0, V, (3, K)))
    b = drafter.forward_train(features, anchors, torch.randint(0, V, (3, K)))
    assert torch.equal(a, b)
    parallel = F.linear(drafter.norm(h), drafter.lm_head_weight)
    torch.testing.assert_close(a, parallel, atol=1e-5, rtol=1e-5)
    # a fresh drafter's head starts at zero
    assert torch.count_nonzero(DLiteDrafter.from_config(make_config()).head.w_out) == 0


def test_feature_mode_and_width_projection():
    feature_mode = make_drafter(feature_mode="feature")
    assert feature_mode.depth_embedding.shape == (1, H)
    features, anchors = random_inputs(2)
    assert feature_mode.draft(features, anchors).logits.shape == (2, K, V)

    torch.manual_seed(0)
    narrow = DLiteDrafter.from_config(make_config(hidden_size=32, target_hidden_size=H))
    assert narrow.embed_tokens is not None and narrow.lm_head is not None
    assert narrow.feature_proj.weight.shape == (32, H)
    assert narrow.draft(features, anchors).token_ids.shape == (2, K)


def test_unbound_drafter_explains_bind_target():
    drafter = DLiteDrafter.from_config(make_config())
    with pytest.raises(RuntimeError, match="bind_target"):
        drafter.draft(*random_inputs(1))
    with pytest.raises(ValueError, match="embed_weight"):
        drafter.bind_target(torch.zeros(V, H + 1), torch.zeros(V, H))


# ============================================================================ checkpoint
def test_save_load_round_trip_is_exact(tmp_path):
    drafter = make_drafter()
    drafter.save_pretrained(tmp_path / "ckpt", TARGET_HF_CONFIG)
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDLiteDraftModel"] and "dlite_config" in config
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    assert set(stored) == set(drafter.state_dict())

    loaded = load_drafter(tmp_path / "ckpt")
    loaded.bind_target(*target_weights())
    features, anchors = random_inputs(4)
    a, b = drafter.draft(features, anchors), loaded.draft(features, anchors)
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logits, b.logits)

    half = load_drafter(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_checkpoint_with_own_embeddings_round_trip(tmp_path):
    torch.manual_seed(0)
    drafter = DLiteDrafter.from_config(make_config(), own_embeddings=True)
    randomise_head(drafter)
    drafter.save_pretrained(tmp_path, TARGET_HF_CONFIG)
    loaded = load_drafter(tmp_path)  # no bind_target needed
    features, anchors = random_inputs(2)
    assert torch.equal(
        drafter.draft(features, anchors).logits, loaded.draft(features, anchors).logits
    )


@pytest.fixture
def saved_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    make_drafter().save_pretrained(directory, TARGET_HF_CONFIG)
    return directory


def test_loader_error_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="directory not found: .*nope"):
        load_drafter(tmp_path / "nope")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_loader_error_missing_file(saved_checkpoint, name):
    (saved_checkpoint / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"{name} is missing"):
        load_drafter(saved_checkpoint)


def test_loader_error_not_dlite_config(saved_checkpoint):
    cfg = json.loads((saved_checkpoint / "config.json").read_text())
    del cfg["dlite_config"]
    (saved_checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json is not a DLite checkpoint"):
        load_drafter(saved_checkpoint)


def test_loader_error_invalid_dlite_config(saved_checkpoint):
    cfg = json.loads((saved_checkpoint / "config.json").read_text())
    cfg["dlite_config"]["head_rank"] = -1
    (saved_checkpoint / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: DLiteConfig\.head_rank"):
        load_drafter(saved_checkpoint)


@pytest.mark.parametrize("damage", ["shape", "missing", "unexpected"])
def test_loader_error_tensor_mismatch(saved_checkpoint, damage):
    from safetensors.torch import load_file, save_file

    weights = saved_checkpoint / "model.safetensors"
    tensors = load_file(str(weights))
    if damage == "shape":
        tensors["head.w_in"] = torch.zeros(RANK + 1, H)
        expected = r"tensor 'head\.w_in' has shape \(9, 64\), config\.json implies \(8, 64\)"
    elif damage == "missing":
        del tensors["norm.weight"]
        expected = r"missing tensors \['norm\.weight'\]"
    else:
        tensors["extra.bias"] = torch.zeros(3)
        expected = r"unexpected tensors \['extra\.bias'\]"
    save_file(tensors, str(weights))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match") as info:
        load_drafter(saved_checkpoint)
    assert len(__import__("re").findall(expected, str(info.value))) == 1


# ============================================================================ teacher
def make_teacher(window=None) -> HistoryTeacher:
    torch.manual_seed(3)
    teacher = HistoryTeacher.from_drafter(make_drafter(), history_window=window).eval()
    randomise_head(teacher)
    with torch.no_grad():  # make history matter visibly
        teacher.history_proj.weight.mul_(20.0)
    return teacher


def teacher_batch(seed=0, S=2, T=12):
    g = torch.Generator().manual_seed(seed)
    seq_features = torch.randn(S, T, L, H, generator=g)
    seq_ids = torch.randint(0, V - 1, (S, T), generator=g)
    seq_index = torch.tensor([0, 1, 0, 1, 0])
    anchor_pos = torch.tensor([6, 3, 1, 10, 9])
    labels = torch.randint(0, V - 1, (5, K), generator=g)
    return seq_features, seq_ids, seq_index, anchor_pos, labels


def test_teacher_has_no_future_leakage_and_sees_history():
    teacher = make_teacher(window=None)
    seq_features, seq_ids, seq_index, anchor_pos, labels = teacher_batch()
    base = teacher.forward_train(seq_features, seq_ids, seq_index, anchor_pos, labels)
    assert base.shape == (5, K, V) and base.dtype == torch.float32
    n = 0  # anchor t = 6 in sequence 0
    t = int(anchor_pos[n])
    future_f, future_ids = seq_features.clone(), seq_ids.clone()
    future_f[0, t:] = torch.randn_like(future_f[0, t:])  # features at >= t
    future_ids[0, t + 1 :] = (future_ids[0, t + 1 :] + 5) % (V - 1)  # tokens after the anchor
    after = teacher.forward_train(future_f, future_ids, seq_index[:1], anchor_pos[:1], labels[:1])
    torch.testing.assert_close(after[0], base[n], atol=1e-5, rtol=1e-5)
    past_f = seq_features.clone()
    past_f[0, t - 3] += 1.0  # a history position (not the local features at t-1)
    changed = teacher.forward_train(past_f, seq_ids, seq_index[:1], anchor_pos[:1], labels[:1])
    assert (changed[0] - base[n]).abs().max() > 1e-3


def test_teacher_packing_equals_one_anchor_at_a_time_and_window():
    teacher = make_teacher(window=4)
    seq_features, seq_ids, seq_index, anchor_pos, labels = teacher_batch()
    together = teacher.forward_train(seq_features, seq_ids, seq_index, anchor_pos, labels)
    for n in range(5):
        one = teacher.forward_train(
            seq_features, seq_ids, seq_index[n : n + 1], anchor_pos[n : n + 1], labels[n : n + 1]
        )
        torch.testing.assert_close(one[0], together[n], atol=1e-5, rtol=1e-5)
    # with a window of 4, positions older than t-4 are invisible
    n, t = 4, 9
    old = seq_features.clone()
    old[0, : t - 4] += 5.0
    out = teacher.forward_train(
        old, seq_ids, seq_index[n : n + 1], anchor_pos[n : n + 1], labels[n : n + 1]
    )
    torch.testing.assert_close(out[0], together[n], atol=1e-5, rtol=1e-5)


def test_teacher_without_history_equals_drafter():
    drafter = make_drafter()
    teacher = HistoryTeacher.from_drafter(drafter, history_window=0)
    teacher.load_state_dict(drafter.state_dict(), strict=False)
    assert set(teacher.drafter_state_dict()) == set(drafter.state_dict())
    seq_features, seq_ids, seq_index, anchor_pos, labels = teacher_batch()
    got = teacher.forward_train(seq_features, seq_ids, seq_index, anchor_pos, labels)
    features = seq_features[seq_index, anchor_pos - 1]
    anchors = seq_ids[seq_index, anchor_pos]
    expected = drafter.forward_train(features, anchors, labels)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_training_forwards_are_differentiable():
    drafter = make_drafter()
    features, anchors = random_inputs(3)
    labels = torch.randint(0, V - 1, (3, K))
    F.cross_entropy(
        drafter.forward_train(features, anchors, labels).flatten(0, 1), labels.flatten()
    ).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.parameters())
    teacher = make_teacher(window=4)
    seq_features, seq_ids, seq_index, anchor_pos, labels = teacher_batch()
    logits = teacher.forward_train(seq_features, seq_ids, seq_index, anchor_pos, labels)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in teacher.parameters())
