"""mindrl: PPO/GRPO post-training for LLMs on megatron-core + vLLM, orchestrated by Ray."""

from setuptools import find_packages, setup

setup(
    name="mindrl",
    version="0.1.0",
    description="RL post-training (PPO/GRPO) for LLMs on megatron-core and vLLM, Ascend NPU / CUDA / CPU",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mindrl", "mindrl.*"]),
    package_data={"mindrl.kernels": ["*.c"]},  # the C kernels' sources, compiled on the host at first use
    python_requires=">=3.10",
    # torch / torch_npu / vllm / vllm-ascend are installed per platform (see README), not here:
    # pinning them would pull the wrong build (e.g. a CUDA torch on an Ascend host).
    install_requires=[
        "megatron-core>=0.12",
        "ray>=2.40",
        "transformers>=4.45",
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "sentencepiece",
        "safetensors",
        "psutil",
        "math-verify",
        "tensorboard",
        "tqdm",
        "pyyaml",
        "jsonschema>=4",  # the tool YAML's schemas and the tool-call arguments (mindrl.agent.tools)
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "parquet": ["pyarrow"],
        # GGUF model files -> HF checkpoints (mindrl-convert gguf2hf, tools/get_model.py)
        "gguf": ["gguf>=0.19", "accelerate>=1.0"],
        # BM25 for the local retrieval server the search tool can use (mindrl-retrieval)
        "retrieval": ["bm25s>=0.3"],
    },
    entry_points={
        "console_scripts": [
            "mindrl-comm=mindrl.cli.comm:main",
            "mindrl-convert=mindrl.cli.convert:main",
            "mindrl-eval=mindrl.cli.eval:main",
            "mindrl-plan=mindrl.cli.plan:main",
            "mindrl-preprocess=mindrl.cli.preprocess:main",
            "mindrl-rollout-server=mindrl.cli.rollout_server:main",
            "mindrl-sampler=mindrl.cli.sampler:main",
            "mindrl-retrieval=mindrl.cli.retrieval:main",
            "mindrl-sandbox=mindrl.cli.sandbox:main",
            "mindrl-sft=mindrl.cli.sft:main",
            "mindrl-train-rm=mindrl.cli.train_rm:main",
            "mindrl-train-dpo=mindrl.cli.train_dpo:main",
            "mindrl-train=mindrl.cli.train:main",
        ]
    },
)
