"""Tests of the DLite training pipeline (format dlite_v1, the authors' recipe) and the offline
acceptance estimator.

Tiny random models only (CPU, 1 thread per process). Covers: each loss (teacher CE, stage-1 KL,
stage-2 CE + L1 with the position weights exp(-k/gamma) and the sum-of-weights normaliser)
against hand-computed values; HF in-process features == feature files (and the vLLM aux
convention); the authors' anchor rule, labels and group ids; a one-command tiny training run
(teacher -> kl -> stable) writing a loadable dlite_v1 checkpoint; stage 1 keeps the teacher's
head frozen; stage time budgets; exact resume (uninterrupted loss curve reproduced bit for bit);
a 2-process gloo torchrun smoke run; the offline estimator is lossless, its tau equals a
brute-force count and it hands the drafter the right group ids and features.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_dlite.train import losses
from vllm_dlite.train.sequences import (
    SequenceStore,
    anchor_range,
    collate,
    plan_batches,
    sample_anchor_positions,
    write_sequences_jsonl,
)
from vllm_dlite.train.features import (
    TargetFeatureExtractor,
    TargetHead,
    read_hs_file,
    write_hs_file,
    write_speculators_dataset,
)

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, N_LAYERS, EOS = 160, 32, 3, 1
MASK = VOCAB - 1
B = 4  # block size (counting the anchor)
K = B - 1


# =========================================================================== fixtures
def make_target(directory: Path, seed: int = 0) -> Path:
    """Random tiny Qwen3 (fp32, tied embeddings, large init so argmaxes are decisive)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=N_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.3, eos_token_id=EOS, pad_token_id=0,
        bos_token_id=0, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    data = json.loads((directory / "config.json").read_text())
    data["torch_dtype"] = "float32"
    data.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(data, indent=2))
    return directory


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def sequences_file(tmp_path_factory) -> Path:
    """12 sequences (prompt 6..30 tokens, response 5..20 tokens) of random ids."""
    rng = np.random.default_rng(0)
    records = []
    for i in range(12):
        prompt, response = int(rng.integers(6, 30)), int(rng.integers(5, 20))
        ids = rng.integers(2, VOCAB - 1, prompt + response).tolist()
        records.append(dict(id=f"s{i}", kind=["agentic", "code", "chat"][i % 3],
                            prompt_len=prompt, token_ids=ids))
    path = tmp_path_factory.mktemp("data") / "sequences.jsonl"
    write_sequences_jsonl(path, records)
    return path


def train_config(target_dir: Path, sequences: Path, root: Path, **run) -> dict:
    return {
        "target": {"path": str(target_dir)},
        "data": {"sequences": str(sequences), "max_len": 64, "anchors_per_seq": 6,
                 "max_tokens_per_batch": 96, "max_seqs_per_batch": 3},
        "model": {"block_size": B, "num_hidden_layers": 1, "sequential_rank": 4, "mask_token_id": MASK,
                  "num_feature_layers": 2, "teacher_window": 5},
        "epochs": {"teacher": 1, "kl": 1, "stable": 1},
        "optim": {"lr": 3e-3},
        "run": {"out": str(root / "drafter"), "work_dir": str(root / "work"), "threads": 1,
                "log_every": 1, "checkpoint_every": 3, "progress": False,
                "tensorboard": False, **run},
    }


def read_metrics(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


# =========================================================================== losses
def test_position_weights_are_zero_based():
    w = losses.position_weights(3, gamma=4.0)  # w_k = exp(-k / gamma), k = 0, 1, 2
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


def test_ce_loss_hand_computed():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # N=1, K=2, V=3
    labels = torch.tensor([[0, 2]])
    ce0 = -math.log(math.exp(2) / (math.exp(2) + 2))
    ce1 = -math.log(1 / (math.e + 2))
    assert losses.ce_loss(logits, labels).item() == pytest.approx((ce0 + ce1) / 2, rel=1e-6)
    mask = torch.tensor([[True, False]])  # inactive position 1: out of numerator and normaliser
    assert losses.ce_loss(logits, labels, mask).item() == pytest.approx(ce0, rel=1e-6)
    w = losses.position_weights(2, gamma=4.0)
    w1 = math.exp(-0.25)
    assert losses.ce_loss(logits, labels, weights=w).item() == pytest.approx(
        (ce0 + w1 * ce1) / (1 + w1), rel=1e-6)


def kl(a, b):
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))


def test_forward_kl_hand_computed_weighted_mean_over_active_positions():
    p = torch.tensor([[[0.5, 0.5], [0.9, 0.1]], [[0.2, 0.8], [0.5, 0.5]]])  # teacher probs
    q = torch.tensor([[[0.25, 0.75], [0.5, 0.5]], [[0.2, 0.8], [0.6, 0.4]]])  # student probs
    w1 = math.exp(-1 / 4)
    w = losses.position_weights(2, gamma=4.0)
    d = [[kl([0.5, 0.5], [0.25, 0.75]), kl([0.9, 0.1], [0.5, 0.5])],
         [kl([0.2, 0.8], [0.2, 0.8]), kl([0.5, 0.5], [0.6, 0.4])]]
    expected = (d[0][0] + w1 * d[0][1] + d[1][0] + w1 * d[1][1]) / (2 * (1 + w1))
    assert losses.forward_kl(p.log(), q.log(), w).item() == pytest.approx(expected, rel=1e-5)
    # anchor 1's second position inactive: normaliser = 1 + w1 + 1
    mask = torch.tensor([[True, True], [True, False]])
    expected_masked = (d[0][0] + w1 * d[0][1] + d[1][0]) / (2 + w1)
    assert losses.forward_kl(p.log(), q.log(), w, mask).item() == pytest.approx(
        expected_masked, rel=1e-5)
    # numerator / normaliser split (what the trainer all-reduces)
    num = losses.weighted_sum(losses.kl_per_position(p.log(), q.log()), mask, w)
    assert (num / losses.normaliser(mask, w)).item() == pytest.approx(expected_masked, rel=1e-5)


def test_stable_loss_hand_computed_ce_and_l1_no_half_factor():
    p_t = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.2, 0.3, 0.5]]])  # N=1, K=3
    q = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]]])
    labels = torch.tensor([[0, 1, 2]])
    logits = q.clamp_min(1e-30).log()
    w1, w2 = math.exp(-1 / 4), math.exp(-2 / 4)
    l1 = [1.0, 1.0, 0.0]  # |q - p|_1 per position, no 1/2 factor
    ce = [-math.log(0.5), -math.log(1.0), -math.log(0.5)]
    Z = 1 + w1 + w2
    tv = (l1[0] + w1 * l1[1] + w2 * l1[2]) / Z
    ce_w = (ce[0] + w1 * ce[1] + w2 * ce[2]) / Z
    w = losses.position_weights(3, gamma=4.0)
    assert losses.tv_l1(p_t, logits, w).item() == pytest.approx(tv, rel=1e-5)
    total, parts = losses.stable_loss(p_t, logits, labels)  # paper: 0.1 CE + 1 TV, gamma 4
    assert parts["ce"].item() == pytest.approx(ce_w, rel=1e-5)
    assert parts["tv"].item() == pytest.approx(tv, rel=1e-5)
    assert total.item() == pytest.approx(0.1 * ce_w + 1.0 * tv, rel=1e-5)
    # the last position inactive: normaliser 1 + w1
    mask = torch.tensor([[True, True, False]])
    total, _ = losses.stable_loss(p_t, logits, labels, mask, gamma=4.0, ce_weight=0.5, tv_weight=2.0)
    expected = (0.5 * (ce[0] + w1 * ce[1]) + 2.0 * (l1[0] + w1 * l1[1])) / (1 + w1)
    assert total.item() == pytest.approx(expected, rel=1e-5)


def test_loss_gradients_reach_student_only():
    student = torch.randn(2, 3, 5, requires_grad=True)
    teacher = torch.randn(2, 3, 5, requires_grad=True)
    losses.forward_kl(teacher, student, losses.position_weights(3)).backward()
    assert student.grad is not None and teacher.grad is None
    probs = torch.softmax(torch.randn(2, 3, 5), -1).requires_grad_(True)
    losses.stable_loss(probs, student, torch.zeros(2, 3, dtype=torch.long))[0].backward()
    assert probs.grad is None


# =========================================================================== features
def test_hf_features_match_speculators_files(target_dir, tmp_path):
    """(a) in-process HF == (b) speculators-format files; aux convention checked via hooks."""
    from transformers import AutoModelForCausalLM

    layer_ids = [0, 2, N_LAYERS]  # embedding output, a middle layer, the last (pre-norm)
    extractor = TargetFeatureExtractor.from_pretrained(target_dir, layer_ids)
    ids = torch.randint(2, VOCAB, (23,), generator=torch.Generator().manual_seed(1))
    out = extractor(ids)
    feats = out.features[0]  # [T, L, H]

    # the vLLM aux convention, independently: id i = output of decoder layer i-1 (pre-norm)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    captured = {}
    hooks = [layer.register_forward_hook(
        lambda mod, args, output, i=i: captured.__setitem__(i + 1, output[0] if isinstance(
            output, tuple) else output)) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    for h in hooks:
        h.remove()
    assert torch.equal(feats[:, 0], model.model.embed_tokens(ids).detach())
    assert torch.equal(feats[:, 1], captured[2][0])
    assert torch.equal(feats[:, 2], captured[N_LAYERS][0])
    assert not torch.allclose(feats[:, 2], out.final_hidden[0])  # HF's last entry is post-norm
    assert torch.allclose(extractor.logits(out.final_hidden[0]), logits, atol=1e-5)
    assert torch.allclose(TargetHead.from_pretrained(target_dir).logits(feats[:, 2]), logits,
                          atol=1e-5)

    # (b) one file, read back by our reader (and a layer subset)
    path = write_hs_file(tmp_path / "hs_0.safetensors", ids, feats, layer_ids)
    back = read_hs_file(path)
    assert back.layer_ids == layer_ids and torch.equal(back.token_ids, ids)
    assert torch.equal(back.features, feats)
    assert torch.equal(read_hs_file(path, layer_ids=[N_LAYERS]).features[:, 0], feats[:, 2])
    # DLite's trainer stores only the rows from row_start on
    part = read_hs_file(write_hs_file(tmp_path / "hs_1.safetensors", ids, feats[7:], layer_ids,
                                      row_start=7))
    assert part.row_start == 7 and torch.equal(part.features, feats[7:])
    assert torch.equal(part.token_ids, ids)

    # (b') a speculators dataset directory, read with speculators' own transfer class
    write_speculators_dataset(tmp_path / "ds", [(ids.tolist(), [0] * 10 + [1] * 13)], extractor,
                              write_table=False)
    hs_connectors = pytest.importorskip("hs_connectors")
    loaded = hs_connectors.FileTransfer(tmp_path / "ds" / "hidden_states").get_cached(0)
    assert torch.equal(loaded["hidden_states"], feats)
    assert torch.equal(loaded["token_ids"], ids)


def test_extractor_cache_continuation_matches_full_forward(target_dir):
    extractor = TargetFeatureExtractor.from_pretrained(target_dir, [1, N_LAYERS])
    ids = torch.randint(2, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    full = extractor(ids)
    first = extractor(ids[:, :12], use_cache=True)
    rest = extractor(ids[:, 12:], past_key_values=first.past_key_values)
    assert torch.allclose(torch.cat([first.features, rest.features], 1), full.features, atol=1e-5)


# =========================================================================== data
def test_anchors_follow_the_authors_rule_labels_and_groups(sequences_file):
    """a in [1, S-B] with loss_mask[a] and loss_mask[a+1] (response from P on), all of them or a
    uniform sample without replacement; labels x_{a+1..a+K}; group x_{a-G+1..a}."""
    store = SequenceStore.open(sequences_file, max_len=40)
    assert len(store) == 12
    for i in range(len(store)):
        S, P = store.length(i), store.response_start(i)
        assert S <= 40
        loss_mask = [p >= P for p in range(S)]
        rule = [a for a in range(1, S - B + 1) if loss_mask[a] and loss_mask[a + 1]]
        pos = sample_anchor_positions(S, P, None, (0,), B)
        assert pos.tolist() == rule
        assert len(rule) == store.num_anchors(i, B)
        assert anchor_range(S, P, B) == (max(P, 1), S - B)
    assert sample_anchor_positions(10, 0, None, (0,), 4).tolist() == list(range(1, 7))  # a >= 1
    assert sample_anchor_positions(10, 8, None, (0,), 4).tolist() == []  # no full block
    long_s, long_p = 200, 10
    few = sample_anchor_positions(long_s, long_p, 5, (7, "x"), B)
    assert len(few) == len(set(few.tolist())) == 5 and np.all(np.diff(few) > 0)
    assert np.array_equal(few, sample_anchor_positions(long_s, long_p, 5, (7, "x"), B))
    assert set(few.tolist()) <= set(range(long_p, long_s - B + 1))
    # uniform: every allowed anchor is drawn about equally often over many keys
    counts = np.zeros(long_s)
    for seed in range(400):
        counts[sample_anchor_positions(long_s, long_p, 32, (seed,), B)] += 1
    allowed = counts[long_p: long_s - B + 1]
    assert counts[:long_p].sum() == 0 and counts[long_s - B + 1:].sum() == 0
    assert allowed.min() > 0.5 * allowed.mean() and allowed.max() < 1.5 * allowed.mean()

    for G in (1, 2):
        batch = collate(store, [0, 5], block_size=B, anchors_per_seq=None, key=(0,), group_size=G)
        assert batch.labels.shape[1] == K and batch.group_ids.shape[1] == G
        assert bool(batch.label_mask.all())
        for n in range(batch.num_anchors):
            s, a = int(batch.seq_index[n]), int(batch.anchor_pos[n])
            toks = store.token_ids(batch.seq_numbers[s])
            assert batch.anchor_ids[n] == toks[a]
            assert batch.group_ids[n].tolist() == toks[a - G + 1: a + 1].tolist()
            assert batch.labels[n].tolist() == toks[a + 1: a + 1 + K].tolist()

    lengths = store.lengths
    seen = []
    for rank in range(2):
        plan = plan_batches(lengths, max_tokens_per_batch=80, max_seqs_per_batch=3, seed=0,
                            key=("stable", 0), rank=rank, world_size=2)
        for b in plan:
            assert len(b) <= 3 and (len(b) == 1 or max(lengths[b]) * len(b) <= 80)
        seen += [i for b in plan for i in b]
    assert len(seen) == len(set(seen))  # no sequence twice in an epoch


# =========================================================================== trainer
def _run_train(config: dict, tmp_path: Path, name: str) -> None:
    from vllm_dlite.train.config import TrainConfig
    from vllm_dlite.train.trainer import Trainer

    Trainer(TrainConfig.from_dict(config)).run()


def test_resume_reproduces_uninterrupted_run(target_dir, sequences_file, tmp_path):
    from vllm_dlite.model import load_drafter

    # log windows of 2 steps, interrupted after step 3: the resumed run must also restore the
    # half-filled metrics window
    full = train_config(target_dir, sequences_file, tmp_path / "full", log_every=2)
    _run_train(full, tmp_path, "full")
    interrupted = train_config(target_dir, sequences_file, tmp_path / "cut", log_every=2,
                               stop_after_steps=3)
    _run_train(interrupted, tmp_path, "cut")
    assert not (tmp_path / "cut" / "drafter" / "config.json").exists()
    interrupted["run"].pop("stop_after_steps")
    _run_train(interrupted, tmp_path, "cut")  # resumes from the step-3 checkpoint

    a, b = read_metrics(tmp_path / "full" / "work"), read_metrics(tmp_path / "cut" / "work")
    assert [r["stage"] for r in a] == [r["stage"] for r in b]
    assert {r["stage"] for r in a} == {"teacher", "kl", "stable"}
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit-exact
    assert [r["acc"] for r in a] == [r["acc"] for r in b]
    wa = (tmp_path / "full" / "drafter" / "model.safetensors").read_bytes()
    wb = (tmp_path / "cut" / "drafter" / "model.safetensors").read_bytes()
    assert wa == wb
    drafter = load_drafter(tmp_path / "full" / "drafter")
    assert drafter.config.block_size == B and drafter.config.target_layer_ids == [0, N_LAYERS - 1]
    report = json.loads((tmp_path / "full" / "drafter" / "training_report.json").read_text())
    assert set(report["stages"]) == {"teacher", "kl", "stable"}


def test_one_command_tiny_run_writes_a_loadable_dlite_v1_checkpoint(target_dir, sequences_file,
                                                                     tmp_path):
    """``python -m vllm_dlite.train --config ...`` end to end (teacher -> kl -> stable, feature
    files, time budget): a dlite_v1 checkpoint that the one loader reads and that drafts."""
    from vllm_dlite.config import ARCHITECTURE_VERSION
    from vllm_dlite.model import check_checkpoint, load_drafter

    cfg = train_config(target_dir, sequences_file, tmp_path, max_steps_per_stage=2)
    cfg["data"]["feature_source"] = "files"
    cfg["run"]["stage_time_budget_s"] = {"stable": 0.0}  # stops stable after its first step
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "vllm_dlite.train", "--config", str(cfg_path)],
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "drafter"
    saved = json.loads((out / "config.json").read_text())
    assert saved["dlite_config"]["architecture_version"] == ARCHITECTURE_VERSION
    assert saved["block_size"] == B and saved["dlite_config"]["anchor_group_size"] == 1
    config = check_checkpoint(out)
    assert config.target_layer_ids == [0, N_LAYERS - 1] and config.aux_layer_ids == [1, N_LAYERS]
    drafter = load_drafter(out, dtype=torch.float32)
    target = TargetFeatureExtractor.from_pretrained(target_dir, config.aux_layer_ids)
    drafter.bind_target(target.embed_weight, *target.final_norm)
    ids = torch.randint(2, VOCAB - 1, (1, 9))
    feats = target(ids).features[:, -1]
    drafted = drafter.draft(feats, ids[:, -1:])
    assert drafted.token_ids.shape == (1, K)
    report = json.loads((out / "training_report.json").read_text())
    assert [r["stage"] for r in read_metrics(tmp_path / "work")] == \
        ["teacher"] * 2 + ["kl"] * 2 + ["stable"]
    assert report["stages"]["stable"]["steps"] == 1
    assert report["stages"]["stable"]["stopped_by_time_budget_s"] == 0.0
    assert report["features"]["aux_layer_ids"] == [1, 2, N_LAYERS]  # drafter + history (0,1,2)
    card = (out / "README.md").read_text()
    assert "dlite_v1" in card and "| stable | 1 | 1 (stopped by the 0 s budget" in card
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5


def test_stage1_student_gets_the_teachers_head_frozen(target_dir, sequences_file, tmp_path):
    """kl stage: the student's sequential head is the trained teacher's and stays frozen; the
    student's backbone (trained from scratch) moves."""
    from safetensors.torch import load_file

    from vllm_dlite.model import load_drafter

    cfg = train_config(target_dir, sequences_file, tmp_path, max_steps_per_stage=2,
                       export_dtype="float32")
    cfg["epochs"] = {"teacher": 1, "kl": 1, "stable": 0}
    _run_train(cfg, tmp_path, "kl")
    teacher = load_file(str(tmp_path / "work" / "teacher.safetensors"))
    student = load_drafter(tmp_path / "drafter").state_dict()
    head = [k for k in student if k.startswith("sequential_head.")]
    assert len(head) == 6
    for k in head:
        assert torch.equal(student[k], teacher[k]), k
    assert not torch.equal(student["layers.0.mlp.up_proj.weight"],
                           teacher["layers.0.mlp.up_proj.weight"])


def test_anchor_chunks_give_the_same_step(target_dir, sequences_file, tmp_path):
    """optim.anchor_chunk_size splits forward/backward without changing the loss."""
    results = []
    for chunk in (0, 4):
        cfg = train_config(target_dir, sequences_file, tmp_path / f"c{chunk}",
                           max_steps_per_stage=1)
        cfg["optim"]["anchor_chunk_size"] = chunk
        cfg["epochs"] = {"teacher": 1, "kl": 1, "stable": 1}
        _run_train(cfg, tmp_path, f"c{chunk}")
        results.append([r["loss"] for r in read_metrics(tmp_path / f"c{chunk}" / "work")])
    assert results[0] == pytest.approx(results[1], rel=1e-5, abs=1e-7)


def test_torchrun_two_process_gloo_smoke(target_dir, sequences_file, tmp_path):
    cfg = train_config(target_dir, sequences_file, tmp_path, max_steps_per_stage=2)
    cfg["data"]["feature_source"] = "files"  # also covers the feature-file training path
    cfg["optim"]["anchor_chunk_size"] = 4  # uneven chunk counts across ranks (padded chunks)
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "-m", "vllm_dlite.train", "--config", str(cfg_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = read_metrics(tmp_path / "work")
    assert [r["stage"] for r in records] == ["teacher"] * 2 + ["kl"] * 2 + ["stable"] * 2
    assert all(math.isfinite(r["loss"]) for r in records)
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    assert len(list((tmp_path / "work" / "data" / "features_v1" / "hidden_states").glob(
        "hs_*.safetensors"))) == 12


def test_cli_config_overrides_and_ablation(tmp_path):
    from vllm_dlite.train.cli import build_parser, resolve_config

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("target: {path: /x}\nrun: {out: /y}\nepochs: {teacher: 8, warmup: 3}\n")
    args = build_parser().parse_args([
        "--config", str(cfg_path), "--set", "optim.lr=1e-4", "--ablation", "stable_only",
        "--ablation", "anchor_group_size=2", "--ablation", "sequential_rank=64"])
    cfg = resolve_config(args).validate()
    assert cfg.optim.lr == 1e-4 and cfg.ablation.stable_only
    assert cfg.model.anchor_group_size == 2 and cfg.model.sequential_rank == 64
    assert cfg.epochs == {"teacher": 8, "kl": 3, "stable": 6}  # "warmup" read as "kl"
    assert cfg.stages() == ["stable"]
    with pytest.raises(ValueError, match="unknown keys"):
        resolve_config(build_parser().parse_args(["--set", "optim.lrr=1"]))


def test_eval_on_the_training_sessions_is_refused_a_validation_seed_is_not():
    """``eval.kinds`` with ``eval.split: train`` is a validation split only with a seed the data did
    not use; the training seed fails at config load, naming the fix."""
    from vllm_dlite.train.config import TrainConfig

    base = {"target": {"path": "/x"}, "run": {"out": "/y"},
            "data": {"regenerate": {"split": "train", "seed": 1}}}
    ok = TrainConfig.from_dict({**base, "eval": {"kinds": {"code": 2}, "split": "train", "seed": 2}})
    assert ok.validate().eval.split == "train"
    bad = TrainConfig.from_dict({**base, "eval": {"kinds": {"code": 2}, "split": "train", "seed": 1}})
    with pytest.raises(ValueError, match="training sessions.*set eval.seed to a seed the data did not use"):
        bad.validate()
    with pytest.raises(ValueError, match="eval.split must be"):
        TrainConfig.from_dict({**base, "eval": {"kinds": {"code": 2}, "split": "test"}}).validate()


def test_model_keys_are_the_dlite_config_fields_and_old_names_are_refused():
    """``model.num_hidden_layers`` / ``model.sequential_rank`` are DLiteConfig's names (the shipped
    config uses them); the earlier names (still in models/*/training_report.json) fail naming the new."""
    from paths import REPO
    from vllm_dlite.train.cli import build_parser, resolve_config
    from vllm_dlite.train.config import TrainConfig

    cfg = resolve_config(build_parser().parse_args(["--config", str(REPO / "configs" / "dlite-tiny.yaml")]))
    assert cfg.model.num_hidden_layers == 2 and cfg.model.sequential_rank == 256
    with pytest.raises(ValueError, match=r"model\.head_rank is now model\.sequential_rank") as err:
        TrainConfig.from_dict({"model": {"head_rank": 4, "num_layers": 1}})
    assert "model.num_layers is now model.num_hidden_layers" in str(err.value) and "\n" not in str(err.value)


# =========================================================================== offline estimator
class BigramOracleDrafter:
    """Stateless test drafter: drafts by following a bigram table (learned from the greedy
    reference), with position 3 always wrong; records the group ids and features it is given.
    Speaks DLiteDrafter's interface (``config.aux_layer_ids``, ``config.num_draft_tokens``,
    ``config.anchor_group_size``, ``draft(features, group_ids, k=)``)."""

    def __init__(self, table: dict[int, int], layer_ids: list[int], k: int, group_size: int = 1):
        self.table = table
        self.config = type("Cfg", (), {"aux_layer_ids": layer_ids, "num_draft_tokens": k,
                                       "anchor_group_size": group_size})()
        self.calls: list[tuple[list[int], torch.Tensor]] = []

    def draft(self, features, group_ids, k=None):
        group = group_ids[0].tolist()
        self.calls.append((group, features[0].clone()))
        out, prev = [], group[-1]
        for i in range(k or self.config.num_draft_tokens):
            prev = self.table.get(prev, 0)
            out.append((prev + 1) % VOCAB if i == 2 else prev)
        return type("Out", (), {"token_ids": torch.tensor([out])})()


def _brute_force_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    seq, out = list(prompt), []
    with torch.no_grad():
        while True:
            token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
            if token == EOS or len(out) >= max_new:
                return out


def _brute_force_features(model, seq: list[int], layer_ids: list[int]) -> torch.Tensor:
    """Row ``len(seq) - 2`` (features of the anchor ``seq[-1]``) by a full forward + hook."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, output: captured.__setitem__("last", output[0] if isinstance(
            output, tuple) else output))
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    hook.remove()
    rows = [captured["last"] if i == N_LAYERS else hs[i] for i in layer_ids]
    return torch.stack(rows, dim=2)[0, -2]


@pytest.mark.parametrize("group_size", [1, 2])
def test_offline_estimator_lossless_and_tau_equals_brute_force(target_dir, group_size):
    """The simulator is lossless, counts tau / per-position acceptance like a brute-force replay,
    and hands the drafter the target's features at a-1 (vLLM aux ids, by full recomputation)
    and the group x_{a-G+1..a}."""
    from transformers import AutoModelForCausalLM

    from vllm_dlite.config import DLiteConfig
    from vllm_dlite.train.offline_eval import SpeculativeSimulator, summarize
    from vllm_dlite.model import DLiteDrafter

    layer_ids = [1, N_LAYERS]
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    extractor = TargetFeatureExtractor(model, layer_ids)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 14)]
    max_new = 30
    refs = [_brute_force_greedy(model, p, max_new) for p in prompts]

    table: dict[int, int] = {}
    for p, ref in zip(prompts, refs, strict=True):
        seq = p + ref
        for a, b in zip(seq[:-1], seq[1:], strict=True):
            table.setdefault(a, b)
    oracle = BigramOracleDrafter(table, layer_ids, k=4, group_size=group_size)
    sim = SpeculativeSimulator(extractor, oracle, k=4, eos_ids={EOS})
    results = [sim.generate(p, max_new) for p in prompts]
    assert [r.output_ids for r in results] == refs  # lossless

    # brute force: rounds over the greedy reference, features by full recomputation
    rounds = accepted = 0
    per_position = [0] * 4
    call = 0
    for p, ref in zip(prompts, refs, strict=True):
        j = 0
        while j < len(ref) - 1 and ref[j] != EOS:
            group, features = oracle.calls[call]
            call += 1
            seq = p + ref[: j + 1]  # the anchor x_a = ref[j] sits at a = len(seq) - 1
            assert group == seq[len(seq) - group_size:]
            expected = _brute_force_features(model, seq, layer_ids)
            assert torch.allclose(features, expected, atol=1e-4)
            drafts = oracle.draft(expected[None], torch.tensor([group])).token_ids[0].tolist()
            oracle.calls.pop()
            a = 0
            while a < 4 and j + 1 + a < len(ref) and drafts[a] == ref[j + 1 + a]:
                a += 1
            appended = min(a + 1, len(ref) - 1 - j)
            rounds += 1
            accepted += min(a, appended)
            for i in range(min(a, appended)):
                per_position[i] += 1
            j += appended
    assert call == len(oracle.calls)
    summary = summarize(results, 4)
    assert summary["rounds"] == rounds and summary["accepted"] == accepted
    assert accepted > 0 and summary["tau"] == round(1 + accepted / rounds, 4)
    assert summary["acceptance_rate_per_position"] == [round(c / rounds, 4) for c in per_position]
    assert summary["acceptance_rate_per_position"][2] == 0.0  # position 3 is always wrong

    # a real (random) dlite_v1 drafter is lossless too
    cfg = DLiteConfig.for_target(model.config.to_dict(), num_feature_layers=2, mask_token_id=MASK,
                                 block_size=5, num_hidden_layers=1, sequential_rank=4,
                                 anchor_group_size=group_size)
    assert cfg.aux_layer_ids == layer_ids
    drafter = DLiteDrafter(cfg).eval()
    drafter.bind_target(extractor.embed_weight, *extractor.final_norm)
    sim = SpeculativeSimulator(extractor, drafter, eos_ids={EOS})
    assert sim.k == 4
    assert [sim.generate(p, max_new).output_ids for p in prompts] == refs


# =========================================================================== one command, new target
@pytest.mark.slow
def test_one_command_trains_a_drafter_for_another_local_qwen3(tmp_path):
    """The documented one-liner (``python -m vllm_dlite.train --target DIR --out DIR``) on a local
    HF Qwen3 model it has never seen: regenerates on-policy data with vLLM, picks the layers,
    trains teacher -> kl -> stable, exports a loadable drafter and evaluates it offline.
    Only the sizes are shrunk (``--set``) so it runs in about two minutes on a CPU, and the
    regeneration engine runs eager (``extra_llm_kwargs``: vLLM's compilation only slows its start-up)."""
    import helpers_vllm as H

    from vllm_dlite.model import load_drafter

    target = H.make_tiny_target(tmp_path / "another-qwen3")
    out = tmp_path / "drafter"
    cmd = [sys.executable, "-m", "vllm_dlite.train", "--target", str(target), "--out", str(out),
           "--work-dir", str(tmp_path / "work"),
           "--set", "data.regenerate.kinds={agentic: 0, code: 2, chat: 3}",
           "--set", "data.regenerate.max_new_tokens=24", "--set", "data.max_len=512",
           "--set", "data.regenerate.extra_llm_kwargs={enforce_eager: true}",
           "--set", "epochs={teacher: 1, kl: 1, stable: 1}",
           "--set", "eval.kinds={chat: 2}", "--set", "eval.max_new_tokens=8", "--set", "run.progress=false"]
    proc = subprocess.run(cmd, env={**os.environ, **H.vllm_env()}, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    drafter = load_drafter(str(out))
    from vllm_dlite.config import build_target_layer_ids
    from vllm_dlite.train.recipe import default_num_feature_layers

    n = H.TARGET_LAYERS
    assert drafter.config.target_layer_ids == build_target_layer_ids(n, default_num_feature_layers(n))
    report = json.loads((out / "training_report.json").read_text())
    assert list(report["stages"]) == ["teacher", "kl", "stable"]
    assert report["data"]["num_sequences"] > 0
    assert report["offline_eval"]["overall"]["tau"] >= 1.0


def test_wait_for_file_survives_the_file_vanishing(tmp_path, monkeypatch):
    """A non-main rank may see rank 0's stale ready-file, which rank 0 then deletes before writing
    it again: the wait goes on (CI once failed here with FileNotFoundError)."""
    import os
    import pathlib

    from vllm_dlite.train.distributed import wait_for_file

    ready = tmp_path / "data.ready"
    ready.write_text("stale\n")
    os.utime(ready, (0, 0))
    looks = []
    real_stat = pathlib.Path.stat

    def stat(self, *a, **k):
        looks.append(self)
        if len(looks) == 2:  # rank 0 deleted the stale file just now
            raise FileNotFoundError(self)
        if len(looks) == 3:  # ... and wrote the fresh one
            ready.write_text("ok\n")
        return real_stat(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    wait_for_file(ready, newer_than=1000.0, poll_s=0.0)
    assert len(looks) == 3


@pytest.mark.slow
def test_training_features_equal_what_vllm_serves(tmp_path):
    """The trainer's features (TargetFeatureExtractor, vLLM aux ids config.aux_layer_ids) are the
    rows vLLM hands the DLite proposer: for every drafting call recorded inside vLLM, the row at
    a-1 of the training extractor on the same tokens (found by the anchor group) matches."""
    import helpers_vllm as H
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_dlite.model import load_drafter

    models = H.tiny_models(tmp_path)
    aux = load_drafter(models.drafter).config.aux_layer_ids
    prompts = H.make_prompts(4)
    run = H.run_llm(models.target, prompts, SamplingParams(temperature=0.0, max_tokens=8,
                                                           ignore_eos=True),
                    {"method": "dlite", "model": str(models.drafter)}, max_num_seqs=4, record=True)
    assert run.records
    extractor = TargetFeatureExtractor.from_pretrained(models.target, aux)
    tok = AutoTokenizer.from_pretrained(str(models.target))
    seqs = []
    for p, out in zip(prompts, run.token_ids, strict=True):
        ids = tok(p)["input_ids"] + out
        seqs.append((ids, extractor(torch.tensor(ids)).features[0]))
    matched = 0
    for rec in run.records:
        n = rec["group_ids"].shape[0]
        feats = rec["features"].view(n, len(aux), -1)
        for b in range(n):
            anchor = rec["group_ids"][b, -1].item()
            errs = [(hf[t - 1] - feats[b]).abs().max().item()
                    for ids, hf in seqs for t in range(1, len(ids)) if ids[t] == anchor]
            assert errs and min(errs) < 1e-3 * max(1.0, feats[b].abs().max().item()), anchor
            matched += 1
    assert matched >= len(prompts)


def test_model_card_of_a_continued_run_names_the_drafter_it_started_from():
    from vllm_dlite.model import read_checkpoint_config
    from vllm_dlite.train.model_card import model_card

    shipped = REPO / "models" / "dlite-qwen3-tiny-stdlib"
    report = json.loads((shipped / "training_report.json").read_text())
    _, dlite = read_checkpoint_config(shipped)
    report["config"]["model"]["init_from"] = None  # the shipped drafter continued one: undo it
    card = model_card(report, dlite)
    assert "Head initialisation (`model.head_init`): target_svd" in card
    assert "Initialisation: the drafter in" not in card
    report["config"]["model"]["init_from"] = "runs/first/model"
    card = model_card(report, dlite)
    assert "Initialisation: the drafter in `runs/first/model` (`model.init_from`)" in card
    assert "Head initialisation" not in card


def test_feature_files_skip_what_another_worker_wrote_meanwhile(target_dir, sequences_file, tmp_path,
                                                                monkeypatch):
    """Two processes may extract into one features directory (e.g. one in reverse order): a file
    that appears after this worker listed its work is not computed again, and the files it does
    write equal a single worker's."""
    from vllm_dlite.train import feature_files
    from vllm_dlite.train.config import TrainConfig
    from vllm_dlite.train.distributed import DistInfo

    cfg = TrainConfig.from_dict(train_config(target_dir, sequences_file, tmp_path))
    cfg.data.features_dtype = "float32"
    store = SequenceStore.open(sequences_file, 64)
    indices, layer_ids = list(range(len(store))), [1, N_LAYERS]
    one = feature_files.write_feature_files(cfg, tmp_path / "one", store, indices, layer_ids,
                                            DistInfo())
    assert one is not None

    calls = []
    real = feature_files.TargetFeatureExtractor.__call__

    def other_worker_writes_the_last_file(self, ids, *a, **k):
        calls.append(len(ids))
        last = feature_files.hs_file_path(tmp_path / "two" / "hidden_states", indices[-1])
        if not last.exists():  # "another worker" finishes the last sequence meanwhile
            src = feature_files.hs_file_path(tmp_path / "one" / "hidden_states", indices[-1])
            last.write_bytes(src.read_bytes())
        return real(self, ids, *a, **k)

    monkeypatch.setattr(feature_files.TargetFeatureExtractor, "__call__", other_worker_writes_the_last_file)
    feature_files.write_feature_files(cfg, tmp_path / "two", store, indices, layer_ids, DistInfo())
    assert len(calls) == len(indices) - 1
    for i in indices:
        a = read_hs_file(feature_files.hs_file_path(tmp_path / "one" / "hidden_states", i))
        b = read_hs_file(feature_files.hs_file_path(tmp_path / "two" / "hidden_states", i))
        assert a.row_start == b.row_start and torch.equal(a.features, b.features)
    assert not list((tmp_path / "two" / "hidden_states").glob("*.tmp"))
