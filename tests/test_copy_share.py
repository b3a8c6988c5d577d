"""The copy definition of lab/experiments/copy_share.py (issue 38's copy-share analysis)."""

from lab.experiments.copy_share import bucket_of, copied_positions


def test_a_reply_position_is_copied_when_the_four_tokens_ending_there_are_in_the_prompt():
    prompt = [1, 2, 3, 4, 5, 6]
    assert copied_positions(prompt, [7, 3, 4, 5, 6, 9]) == [False, False, False, False, True, False]
    # before the reply's 4th token the prompt's last 3 tokens fill in
    assert copied_positions([4, 5, 6, 1, 4, 5, 6], [1]) == [True]   # (4, 5, 6, 1) is in the prompt
    assert copied_positions([9, 4, 5, 6, 2], [1]) == [False]        # (5, 6, 2, 1) is not


def test_prompt_buckets():
    assert [bucket_of(n) for n in (532, 2047, 2048, 8191, 8192, 28869)] == \
        ["0-2k", "0-2k", "2k-8k", "2k-8k", "8k-32k", "8k-32k"]
