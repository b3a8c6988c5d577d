"""``python -m vllm_dlite.train.baselines``: train and export one baseline drafter (see the package)."""

from vllm_dlite.train.baselines import main

main()
