"""The copy definition of lab/experiments/copy_share.py (issue 38's copy-share analysis)."""

from lab.buckets import prompt_bucket
from lab.experiments.copy_share import copied_positions


def test_a_reply_position_is_copied_when_the_four_tokens_ending_there_are_in_the_prompt():
    prompt = [1, 2, 3, 4, 5, 6]
    assert copied_positions(prompt, [7, 3, 4, 5, 6, 9]) == [False, False, False, False, True, False]
    # before the reply's 4th token the prompt's last 3 tokens fill in
    assert copied_positions([4, 5, 6, 1, 4, 5, 6], [1]) == [True]   # (4, 5, 6, 1) is in the prompt
    assert copied_positions([9, 4, 5, 6, 2], [1]) == [False]        # (5, 6, 2, 1) is not


def test_prompt_buckets():
    assert [prompt_bucket(n) for n in (0, 532, 2047, 2048, 8191, 8192, 28869, 32768)] == \
        ["0-2k", "0-2k", "0-2k", "2k-8k", "2k-8k", "8k-32k", "8k-32k", None]


def test_reached_draft_slots_follow_the_verifications():
    from lab.experiments.copy_share import reached_slots

    # reply of 12 tokens: the prefill gives position 0; then verifications [drafted, accepted]
    rounds = [[3, 3], [3, 1], [0, 0], [3, 0], [3, 2]]
    slots, covered = reached_slots(12, rounds)
    # [3, 3] drafts 1..3, all accepted (no rejected slot); [3, 1] drafts 5..7: 5 accepted, 6 rejected;
    # [0, 0] no drafts (position 7 from the target); [3, 0] drafts 8..: 8 rejected; [3, 2] drafts 9..11
    assert slots == [(1, True), (2, True), (3, True), (5, True), (6, False), (8, False),
                     (9, True), (10, True), (11, False)]
    assert covered == 1 + 4 + 2 + 1 + 1 + 3 == 12
    # slots past the reply's end (max tokens reached inside a verification) are not counted
    assert reached_slots(10, rounds)[0][-1] == (9, True)


def test_token_acceptance_splits_reached_slots_by_copy():
    from lab.experiments.copy_share import token_acceptance

    replies = [[0] * 5]
    copied = [[False, True, True, False, False]]
    methods = {"m": {"per_request_rounds": [[[3, 2], [2, 0]]]}}  # slots 1, 2 ok, 3 rejected; then 4 rejected
    out = token_acceptance(methods, replies, copied, {"all": [0]})
    assert out == {"m": {"all": {"copied": [2, 2], "not_copied": [0, 2]}}}
    bad = {"m": {"per_request_rounds": [[[3, 0]]]}}  # covers 2 tokens of a 5-token reply
    import pytest

    with pytest.raises(SystemExit, match="cover 2 tokens"):
        token_acceptance(bad, replies, copied, {"all": [0]})


def test_acceptance_past_each_drafters_training_length(tmp_path):
    from lab.experiments.copy_share import acceptance_past_training_length, training_length

    replies, copied = [[0] * 5], [[False, True, True, False, False]]
    methods = {"m": {"per_request_rounds": [[[3, 2], [2, 0]]]}}  # reached slots 1, 2 (ok), 3, 4 (rejected)
    # a 100-token prompt and a training length of 102: positions 101, 102 within, 103, 104 past
    out = acceptance_past_training_length(methods, [100], replies, copied, {"m": 102})
    assert out == {"m": {"training_length": 102, "within": {"copied": [2, 2], "not_copied": [0, 0]},
                         "past": {"copied": [0, 0], "not_copied": [0, 2]}}}
    (tmp_path / "README.md").write_text("- command: `python -m lab.baselines --method eagle3 --max-len 4096 --epochs 6`")
    assert training_length(tmp_path) == 4096
    assert training_length(tmp_path / "missing") is None
