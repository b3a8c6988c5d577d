"""Tests of the DLite training pipeline and the offline acceptance estimator.

Tiny random models only (CPU, 1 thread per process). Covers: each loss against a hand-computed
case; HF in-process features == speculators-file features (and the vLLM aux convention); anchors,
labels and batch planning; exact resume (uninterrupted loss curve reproduced bit for bit); a
2-process gloo torchrun smoke run; the offline estimator is lossless and its tau equals a
brute-force count.
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
from vllm_dlite.train.data import (
    SequenceStore,
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
K = 3


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
        "model": {"block_size": K, "num_layers": 1, "head_rank": 4, "mask_token_id": MASK,
                  "history_window": 16},
        "epochs": {"teacher": 1, "warmup": 1, "stable": 1},
        "optim": {"lr": 3e-3},
        "run": {"out": str(root / "drafter"), "work_dir": str(root / "work"), "threads": 1,
                "log_every": 1, "checkpoint_every": 3, "progress": False,
                "tensorboard": False, **run},
    }


def read_metrics(work: Path) -> list[dict]:
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


# =========================================================================== losses
def test_position_weights():
    w = losses.position_weights(3, gamma=4.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


def test_ce_loss_hand_computed():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])  # N=1, K=2, V=3
    labels = torch.tensor([[0, 2]])
    ce0 = -math.log(math.exp(2) / (math.exp(2) + 2))
    ce1 = -math.log(1 / (math.e + 2))
    assert losses.ce_loss(logits, labels).item() == pytest.approx((ce0 + ce1) / 2, rel=1e-6)
    # masked position 1 is ignored
    mask = torch.tensor([[True, False]])
    assert losses.ce_loss(logits, labels, mask).item() == pytest.approx(ce0, rel=1e-6)
    # weighted token mean: (w0 ce0 + w1 ce1) / (w0 + w1)
    w = torch.tensor([1.0, 0.5])
    assert losses.ce_loss(logits, labels, weights=w).item() == pytest.approx(
        (ce0 + 0.5 * ce1) / 1.5, rel=1e-6)


def test_forward_kl_hand_computed():
    p = torch.tensor([[[0.5, 0.5], [0.9, 0.1]], [[0.2, 0.8], [0.5, 0.5]]])  # teacher probs
    q = torch.tensor([[[0.25, 0.75], [0.5, 0.5]], [[0.2, 0.8], [0.6, 0.4]]])  # student probs
    w = losses.position_weights(2)

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))

    expected = (
        (kl([0.5, 0.5], [0.25, 0.75]) + w[1].item() * kl([0.9, 0.1], [0.5, 0.5]))
        + (kl([0.2, 0.8], [0.2, 0.8]) + w[1].item() * kl([0.5, 0.5], [0.6, 0.4]))
    ) / 2  # per-anchor sum over positions, mean over anchors
    got = losses.forward_kl(p.log(), q.log(), w)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    # mask out anchor 1's second position: the anchor still counts in the mean
    mask = torch.tensor([[True, True], [True, False]])
    expected_masked = (kl([0.5, 0.5], [0.25, 0.75]) + w[1].item() * kl([0.9, 0.1], [0.5, 0.5])
                       + 0.0) / 2
    assert losses.forward_kl(p.log(), q.log(), w, mask).item() == pytest.approx(
        expected_masked, rel=1e-5)


def test_tv_l1_hand_computed_no_half_factor():
    p_t = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]]])  # N=1, K=2
    q = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]]])
    w = losses.position_weights(2, gamma=4.0)
    l1_0 = 0.5 + 0.25 + 0.25  # = 1.0
    l1_1 = 0.0 + 0.5 + 0.5  # = 1.0
    expected = l1_0 + math.exp(-0.25) * l1_1
    logits = q.clamp_min(1e-30).log()
    assert losses.tv_l1(p_t, logits, w).item() == pytest.approx(expected, rel=1e-5)
    total, parts = losses.stable_loss(p_t, logits, torch.tensor([[0, 1]]))
    ce = (-math.log(0.5) - math.log(1.0)) / 2
    assert parts["ce"].item() == pytest.approx(ce, rel=1e-5)
    assert total.item() == pytest.approx(0.1 * ce + 1.0 * expected, rel=1e-5)


def test_loss_gradients_reach_student_only():
    student = torch.randn(2, 3, 5, requires_grad=True)
    teacher = torch.randn(2, 3, 5, requires_grad=True)
    losses.forward_kl(teacher, student, losses.position_weights(3)).backward()
    assert student.grad is not None and teacher.grad is None


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
def test_anchors_labels_and_batches(sequences_file):
    store = SequenceStore.open(sequences_file, max_len=40)
    assert len(store) == 12
    for i in range(len(store)):
        assert store.length(i) <= 40
        pos = sample_anchor_positions(store.length(i), store.response_start(i), None, (0,))
        assert pos[0] == max(1, store.response_start(i)) and pos[-1] == store.length(i) - 2
        assert len(pos) == store.num_anchors(i)
    few = sample_anchor_positions(store.length(0), store.response_start(0), 3, (7, "x"))
    assert len(few) == 3 and np.array_equal(
        few, sample_anchor_positions(store.length(0), store.response_start(0), 3, (7, "x")))

    batch = collate(store, [0, 5], block_size=K, anchors_per_seq=None, key=(0,))
    for n in range(batch.num_anchors):
        s, t = int(batch.seq_index[n]), int(batch.anchor_pos[n])
        toks = store.token_ids(batch.seq_numbers[s])
        assert batch.anchor_ids[n] == toks[t]
        for i in range(K):
            valid = t + 1 + i < len(toks)
            assert bool(batch.label_mask[n, i]) == valid
            if valid:
                assert batch.labels[n, i] == toks[t + 1 + i]

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
    from vllm_dlite.train.trainer import TrainConfig, Trainer

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
    assert {r["stage"] for r in a} == {"teacher", "warmup", "stable"}
    assert [r["loss"] for r in a] == [r["loss"] for r in b]  # bit-exact
    assert [r["acc"] for r in a] == [r["acc"] for r in b]
    wa = (tmp_path / "full" / "drafter" / "model.safetensors").read_bytes()
    wb = (tmp_path / "cut" / "drafter" / "model.safetensors").read_bytes()
    assert wa == wb
    drafter = load_drafter(tmp_path / "full" / "drafter")
    assert drafter.config.block_size == K and drafter.config.target_layer_ids == [1, 2, 3]
    report = json.loads((tmp_path / "full" / "drafter" / "training_report.json").read_text())
    assert set(report["stages"]) == {"teacher", "warmup", "stable"}


def test_anchor_chunks_give_the_same_step(target_dir, sequences_file, tmp_path):
    """optim.anchor_chunk_size splits forward/backward without changing the loss."""
    results = []
    for chunk in (0, 4):
        cfg = train_config(target_dir, sequences_file, tmp_path / f"c{chunk}",
                           max_steps_per_stage=1)
        cfg["optim"]["anchor_chunk_size"] = chunk
        cfg["epochs"] = {"teacher": 1, "warmup": 0, "stable": 1}
        _run_train(cfg, tmp_path, f"c{chunk}")
        results.append([r["loss"] for r in read_metrics(tmp_path / f"c{chunk}" / "work")])
    assert results[0] == pytest.approx(results[1], rel=1e-5)


def test_torchrun_two_process_gloo_smoke(target_dir, sequences_file, tmp_path):
    cfg = train_config(target_dir, sequences_file, tmp_path, max_steps_per_stage=2)
    cfg["data"]["feature_source"] = "files"  # also covers the speculators-file training path
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
    assert [r["stage"] for r in records] == ["teacher"] * 2 + ["warmup"] * 2 + ["stable"] * 2
    assert all(math.isfinite(r["loss"]) for r in records)
    assert (tmp_path / "drafter" / "model.safetensors").is_file()
    assert len(list((tmp_path / "work" / "data" / "features" / "hidden_states").glob(
        "hs_*.safetensors"))) == 12


def test_cli_config_overrides_and_ablation(tmp_path):
    from vllm_dlite.train.cli import build_parser, resolve_config

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("target: {path: /x}\nrun: {out: /y}\nepochs: {teacher: 8}\n")
    args = build_parser().parse_args([
        "--config", str(cfg_path), "--set", "optim.lr=1e-4", "--ablation", "stable_only",
        "--ablation", "feature_mode=feature", "--ablation", "head_rank=64"])
    cfg = resolve_config(args).validate()
    assert cfg.optim.lr == 1e-4 and cfg.ablation.stable_only
    assert cfg.model.feature_mode == "feature" and cfg.model.head_rank == 64
    assert cfg.stages() == ["stable"]
    with pytest.raises(ValueError, match="unknown keys"):
        resolve_config(build_parser().parse_args(["--set", "optim.lrr=1"]))


# =========================================================================== offline estimator
class BigramOracleDrafter:
    """Stateless test drafter: drafts by following a bigram table (learned from the greedy
    reference), with position 3 always wrong; records the features it is given."""

    def __init__(self, table: dict[int, int], layer_ids: list[int], k: int):
        self.table = table
        self.config = type("Cfg", (), {"target_layer_ids": layer_ids, "block_size": k})()
        self.calls: list[tuple[int, torch.Tensor]] = []

    def draft(self, features, anchor_ids):
        anchor = int(anchor_ids[0])
        self.calls.append((anchor, features[0].clone()))
        out, prev = [], anchor
        for i in range(self.config.block_size):
            prev = self.table.get(prev, 0)
            out.append((prev + 1) % VOCAB if i == 2 else prev)
        return (torch.tensor([out]),)


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


def test_offline_estimator_lossless_and_tau_equals_brute_force(target_dir):
    from transformers import AutoModelForCausalLM

    from vllm_dlite.config import DLiteConfig
    from vllm_dlite.eval.offline import SpeculativeSimulator, summarize
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
    oracle = BigramOracleDrafter(table, layer_ids, k=4)
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
            anchor, features = oracle.calls[call]
            call += 1
            assert anchor == ref[j]
            expected = _brute_force_features(model, p + ref[: j + 1], layer_ids)
            assert torch.allclose(features, expected, atol=1e-4)
            drafts = oracle.draft(expected[None], torch.tensor([ref[j]]))[0][0].tolist()
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

    # a real (random) DLite drafter is lossless too
    cfg = DLiteConfig.for_target(model.config.to_dict(), num_feature_layers=2, mask_token_id=MASK,
                                 block_size=4, num_layers=1, head_rank=4)
    drafter = DLiteDrafter.from_config(cfg).eval()
    drafter.bind_target(extractor.embed_weight, extractor.lm_head_weight)
    sim = SpeculativeSimulator(extractor, drafter, eos_ids={EOS})
    assert [sim.generate(p, max_new).output_ids for p in prompts] == refs


# =========================================================================== one command, new target
@pytest.mark.slow
def test_one_command_trains_a_drafter_for_another_local_qwen3(tmp_path):
    """The documented one-liner (``python -m vllm_dlite.train --target DIR --out DIR``) on a local
    HF Qwen3 model it has never seen: regenerates on-policy data with vLLM, picks the layers,
    trains teacher -> warm-up -> stable, exports a loadable drafter and evaluates it offline.
    Only the sizes are shrunk (``--set``) so it runs in about two minutes on a CPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import helpers_vllm as H

    from vllm_dlite.model import load_drafter

    target = H.make_tiny_target(tmp_path / "another-qwen3")
    out = tmp_path / "drafter"
    cmd = [sys.executable, "-m", "vllm_dlite.train", "--target", str(target), "--out", str(out),
           "--work-dir", str(tmp_path / "work"),
           "--set", "data.regenerate.kinds={agentic: 0, code: 2, chat: 3}",
           "--set", "data.regenerate.max_new_tokens=24", "--set", "data.max_len=512",
           "--set", "epochs={teacher: 1, warmup: 1, stable: 1}",
           "--set", "eval.kinds={chat: 2}", "--set", "eval.max_new_tokens=8", "--set", "run.progress=false"]
    proc = subprocess.run(cmd, env={**os.environ, **H.vllm_env()}, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    drafter = load_drafter(str(out))
    assert drafter.config.target_layer_ids == list(range(1, H.TARGET_LAYERS + 1))
    report = json.loads((out / "training_report.json").read_text())
    assert list(report["stages"]) == ["teacher", "warmup", "stable"]
    assert report["data"]["num_sequences"] > 0
    assert report["offline_eval"]["overall"]["tau"] >= 1.0


def test_wait_for_file_survives_the_file_vanishing(tmp_path, monkeypatch):
    """A non-main rank may see rank 0's stale ready-file, which rank 0 then deletes before writing
    it again: the wait goes on (CI once failed here with FileNotFoundError)."""
    import os
    import pathlib

    from vllm_dlite.train.trainer import wait_for_file

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
