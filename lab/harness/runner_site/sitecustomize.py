"""Started by Python in every process whose PYTHONPATH holds this folder
(``lab.harness.runners.runner_env("v2")``): Model Runner V2 on CPU before anything imports vLLM."""

try:
    from lab.harness.runners import enable_v2_on_cpu
except ImportError:  # the repository root is not on the path: put it there (lab/harness/runner_site)
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parents[3]))
    from lab.harness.runners import enable_v2_on_cpu

enable_v2_on_cpu()
