"""``python -m lab.baselines``: train and export one baseline drafter (see the package)."""

from lab.baselines import main

main()
