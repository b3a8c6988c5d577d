"""At temperature > 0, DLite in vLLM leaves the output distribution equal to the target's.

Controlled setting: the tiny random-weight target of ``helpers_vllm`` (vocab 384), one prompt,
``N`` independent requests sampled at temperature ``T``. The exact target distribution of the first
two generated tokens is enumerated with HF in fp32::

    P(y1, y2) = softmax(z(x) / T)[y1] * softmax(z(x, y1) / T)[y2]

Token 1 comes from the target's prefill; token 2 is the first token that goes through vLLM's
rejection sampler (the drafter drafted it from anchor y1), so the joint (y1, y2) covers both the
plain and the speculative path. A chi-square goodness-of-fit test (cells with expected count < 5
pooled) compares the empirical joint with P, for no speculation (the control: the harness itself
must pass) and for DLite with the copy drafter (many acceptances) under both draft sampling
methods, on Model Runner V1 and V2 (``runner``). Engines are seeded, so the test is deterministic;
alpha = 1e-3.
"""

from __future__ import annotations

import collections

import pytest
import torch

import helpers_vllm as H  # noqa: E402

H.apply_vllm_env()
torch.set_num_threads(1)

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

PROMPT = "The quick brown"
TEMPERATURE = 1.0
NUM_REQUESTS = 2000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def exact_joint(models) -> torch.Tensor:
    """``P[y1, y2]`` of the target for the first two sampled tokens, ``[V, V]`` fp64."""
    from transformers import AutoTokenizer

    model = H._hf_model(str(models.target))
    ids = AutoTokenizer.from_pretrained(str(models.target)).encode(PROMPT)
    with torch.no_grad():
        z1 = model(torch.tensor([ids])).logits[0, -1].double()  # [V]
        p1 = torch.softmax(z1 / TEMPERATURE, -1)
        vocab = p1.numel()
        batch = torch.tensor([ids + [y1] for y1 in range(vocab)])  # [V, P+1]
        z2 = model(batch).logits[:, -1].double()  # [V, V]
        p2 = torch.softmax(z2 / TEMPERATURE, -1)
    return p1[:, None] * p2


def chi_square_p_value(counts: collections.Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Goodness of fit of ``counts`` (cell -> count) to ``probs`` (flattened cells); returns
    ``(p_value, degrees_of_freedom)``. Cells with expected count < 5 are pooled into one."""
    flat = probs.flatten()
    expected = flat * n
    big = expected >= 5
    observed = torch.zeros_like(flat)
    for cell, c in counts.items():
        observed[cell] = c
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = (((obs - exp) ** 2) / exp)[keep].sum()
    dof = int(keep.sum()) - 1
    # chi2 survival function: Q(dof / 2, stat / 2), the regularised upper incomplete gamma
    p = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2)
    return float(p), dof


def sample_joint(models, speculative_config=None, runner="v1"):
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=4, ignore_eos=True)
    run = H.run_llm(models.target, [PROMPT] * NUM_REQUESTS, params, speculative_config,
                    max_num_seqs=128, runner=runner)
    assert run.runner == runner
    vocab = H.TARGET_VOCAB
    counts = collections.Counter(t[0] * vocab + t[1] for t in run.token_ids)
    return counts, run


@pytest.mark.slow
@pytest.mark.parametrize("draft_sample_method", [None, "greedy", "probabilistic"],
                         ids=["no-speculation", "dlite-greedy-drafts", "dlite-probabilistic-drafts"])
def test_sampled_distribution_equals_target(models, exact_joint, runner, draft_sample_method):
    assert exact_joint.shape == (H.TARGET_VOCAB, H.TARGET_VOCAB)
    spec = None
    if draft_sample_method is not None:
        spec = {"method": "dlite", "model": str(models.copy_drafter),
                "num_speculative_tokens": H.BLOCK_K, "draft_sample_method": draft_sample_method}
    counts, run = sample_joint(models, spec, runner)
    assert sum(counts.values()) == NUM_REQUESTS
    p, dof = chi_square_p_value(counts, exact_joint, NUM_REQUESTS)
    accepted = run.metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    print(f"{draft_sample_method}: chi2 p={p:.3g}, dof={dof}, accepted draft tokens={accepted}")
    assert dof >= 3, "the distribution is too peaked for the test to mean anything"
    if spec is not None:  # speculation really happened and drafts were accepted
        assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert p > ALPHA, f"sampled (y1, y2) differ from the target's distribution: p={p:.2e}, dof={dof}"


def test_chi_square_detects_a_wrong_distribution():
    """The test statistic itself: a sample of P passes, a sample of a perturbed P fails."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 6, generator=gen, dtype=torch.float64) * 2, -1) / 6
    wrong = probs.clone()
    wrong[:, 0] *= 1.5  # e.g. a sampler that over-accepts one token
    wrong /= wrong.sum()
    for dist, should_pass in ((probs, True), (wrong, False)):
        cells = torch.multinomial(dist.flatten(), NUM_REQUESTS, replacement=True, generator=gen)
        counts = collections.Counter(cells.tolist())
        p, _ = chi_square_p_value(counts, probs, NUM_REQUESTS)
        assert (p > ALPHA) == should_pass, p
