"""Tests of the sliding-window teacher ``swa_teacher`` (vllm_dlite/model/teacher.py; tiny dims,
CPU, fast): what it equals without history, that history matters and is positional, the window,
history gathering, and the head hand-over to the student."""

from __future__ import annotations

import pytest
import torch

from vllm_dlite.config import DLiteConfig
from vllm_dlite.model import DLiteDrafter
from vllm_dlite.model.teacher import SWATeacher, default_history_layer_ids, gather_history

torch.set_num_threads(1)

H, V, N, B = 64, 97, 6, 5
K = B - 1
TARGET = {"model_type": "qwen3", "hidden_size": H, "num_hidden_layers": N,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "intermediate_size": 128, "vocab_size": V, "rope_theta": 10000.0}


def make_config(G: int = 1) -> DLiteConfig:
    return DLiteConfig.for_target(TARGET, num_feature_layers=3, mask_token_id=V - 1, block_size=B,
                                  num_hidden_layers=2, sequential_rank=8, anchor_group_size=G)


def bind(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model.bind_target(torch.randn(V, H, generator=g), 1 + 0.1 * torch.randn(H, generator=g), 1e-6)
    return model


def make_pair(G: int = 1, window: int = 8):
    torch.manual_seed(0)
    teacher = bind(SWATeacher(make_config(G), window=window)).eval()
    with torch.no_grad():  # larger weights so history effects are visible in the logits
        teacher.history_proj.weight.mul_(20.0)
        teacher.sequential_head.output_proj.weight.mul_(50.0)
        teacher.sequential_head.state_hidden_mlp.weight.mul_(10.0)
    drafter = bind(DLiteDrafter(make_config(G))).eval()
    drafter.load_state_dict(teacher.student_state_dict())
    return teacher, drafter


def inputs(b: int = 3, G: int = 1, slots: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, 3, H, generator=g) * 2
    group = torch.randint(0, V - 1, (b, G), generator=g)
    labels = torch.randint(0, V - 1, (b, K), generator=g)
    history = torch.randn(b, slots, 3, H, generator=g) * 2
    return feats, group, labels, history


def test_history_layers_default_and_aux_ids():
    assert default_history_layer_ids(12) == [0, 6, 11]
    assert default_history_layer_ids(36) == [0, 18, 35]
    teacher = SWATeacher(make_config(), window=32)
    assert teacher.history_layer_ids == [0, 3, 5] and teacher.history_aux_ids == [1, 4, 6]
    assert teacher.num_history_slots == 31
    assert teacher.history_proj.weight.shape == (H, 3 * H)  # Linear(3H -> H), no bias
    assert teacher.history_proj.bias is None
    extra = set(teacher.state_dict()) - set(DLiteDrafter(make_config()).state_dict())
    assert extra == {"history_proj.weight", "history_norm.weight"}


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("window", [0, 1])
def test_teacher_without_history_slots_equals_the_student(G, window):
    """window W <= 1 means W-1 = 0 history slots: the teacher IS the student (same weights)."""
    teacher, drafter = make_pair(G, window)
    feats, group, labels, history = inputs(G=G)
    got = teacher.forward_train(feats, group, labels, history=history[:, :0])
    assert torch.equal(got, drafter.forward_train(feats, group, labels))
    assert torch.equal(teacher.forward_train(feats, group, labels),
                       drafter.forward_train(feats, group, labels))
    with pytest.raises(ValueError, match="window allows 0"):
        teacher.forward_train(feats, group, labels, history=history)


@pytest.mark.parametrize("G", [1, 2])
def test_fully_masked_history_equals_the_student_and_history_matters(G):
    teacher, drafter = make_pair(G)
    feats, group, labels, history = inputs(G=G)
    student = drafter.forward_train(feats, group, labels)
    none = torch.zeros(history.shape[:2], dtype=torch.bool)
    masked = teacher.forward_train(feats, group, labels, history=history, history_valid=none)
    assert torch.allclose(masked, student, atol=1e-5)
    seen = teacher.forward_train(feats, group, labels, history=history)
    assert (seen - student).abs().max() > 1e-3
    # masking one anchor's history only changes that anchor
    valid = torch.ones(history.shape[:2], dtype=torch.bool)
    valid[1] = False
    part = teacher.forward_train(feats, group, labels, history=history, history_valid=valid)
    assert torch.allclose(part[1], student[1], atol=1e-5)
    assert torch.allclose(part[[0, 2]], seen[[0, 2]], atol=1e-5)


def test_history_is_positional_and_requests_are_independent():
    teacher, _ = make_pair()
    feats, group, labels, history = inputs()
    base = teacher.forward_train(feats, group, labels, history=history)
    swapped = history.clone()
    swapped[:, [0, 6]] = history[:, [6, 0]]  # same slots, other positions (RoPE)
    assert (teacher.forward_train(feats, group, labels, history=swapped) - base).abs().max() > 1e-4
    one = teacher.forward_train(feats[:1], group[:1], labels[:1], history=history[:1])
    assert torch.allclose(one, base[:1], atol=1e-5)
    # the RNN is teacher-forced: step k depends on labels[:, :k] only
    changed = labels.clone()
    changed[:, -1] = (changed[:, -1] + 1) % (V - 1)
    assert torch.equal(teacher.forward_train(feats, group, changed, history=history), base)


def test_gather_history_window_and_validity():
    S, T, nh = 2, 12, 3
    rows = torch.arange(S * T, dtype=torch.float32).reshape(S, T, 1, 1).expand(S, T, nh, 2).clone()
    row_start = torch.tensor([0, 4])  # sequence 1 stores positions 4..15
    seq = torch.tensor([0, 0, 1])
    pos = torch.tensor([9, 2, 10])
    hist, valid = gather_history(rows, row_start, seq, pos, num_slots=4)
    assert hist.shape == (3, 4, nh, 2)
    # anchor a=9 (seq 0): positions 4, 5, 6, 7 (= a-W .. a-2 with W = 5; a-1 = 8 is current)
    assert hist[0, :, 0, 0].tolist() == [4.0, 5.0, 6.0, 7.0] and valid[0].all()
    # a=2: positions -3..0: only position 0 exists
    assert valid[1].tolist() == [False, False, False, True] and hist[1, 3, 0, 0] == 0.0
    assert hist[1, :3].abs().sum() == 0
    # seq 1, a=10: positions 5..8 -> stored rows 1..4 of sequence 1 (= values T + 1 ..)
    assert hist[2, :, 0, 0].tolist() == [float(T + r) for r in (1, 2, 3, 4)]
    _, early = gather_history(rows, row_start, torch.tensor([1]), torch.tensor([7]), 4)
    assert early[0].tolist() == [False, False, True, True]  # positions 2, 3 < row_start 4
    empty, none = gather_history(rows, row_start, seq, pos, 0)
    assert empty.shape == (3, 0, nh, 2) and none.shape == (3, 0)


def test_head_hand_over_to_the_student():
    teacher, _ = make_pair()
    student = bind(DLiteDrafter(make_config()))
    student.load_state_dict(teacher.head_state_dict(), strict=False)
    for name, value in student.sequential_head.state_dict().items():
        assert torch.equal(value, teacher.sequential_head.state_dict()[name])


def test_head_init_from_target_lm_head_is_its_rank_r_truncation():
    """model.head_init = target_svd: the head's logits start as the target lm_head's rank-r
    truncated SVD applied to d (the state columns keep their random init)."""
    from vllm_dlite.train.recipe import init_head_from_target

    teacher, _ = make_pair()
    lm_head = torch.randn(V + 3, H, generator=torch.Generator().manual_seed(5))  # padded rows
    init_head_from_target(teacher, lm_head)
    head, r = teacher.sequential_head, teacher.config.sequential_rank
    d = torch.randn(4, H)
    o = head.state_hidden_mlp(torch.cat([torch.zeros(4, r), d], -1)) - head.state_hidden_mlp.bias
    U, S, Vh = torch.linalg.svd(lm_head[:V], full_matrices=False)
    expected = d @ ((U[:, :r] * S[:r]) @ Vh[:r]).T
    assert torch.allclose(head.output_proj(o), expected, atol=1e-4)
