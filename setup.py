"""isojax: compute-optimal RL post-training budgets (Bp, n, M) in JAX.

Extras follow the users:
  pip install isojax              the analysis (NumPy, SciPy, Matplotlib): what a
                                  notebook needs to fit copied run directories
  pip install "isojax[train]"     the JAX trainer, sampler, sweeps and launchers
  pip install "isojax[vllm]"      the trainer plus the vLLM client (the server runs in
                                  its own virtualenv: launch/setup_vllm_venv.sh)
  pip install "isojax[test]"      everything the test suite needs
"""

import setuptools

# The analysis never imports the trainer (tests/test_packaging.py checks it).
ANALYSIS = [
    "numpy>=2.0",
    "scipy>=1.13",
    "matplotlib>=3.9",
]
# Pinned: the trainer's numerics (and the stored one-step regression numbers in
# tests) are only reproducible on a fixed stack.
TRAIN = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "transformers>=5.0,<6",
    "safetensors>=0.8",
    "absl-py>=2.1",
    "ml-collections>=1.0",
    "math-verify>=0.8",
    "tensorboardX>=2.6",
    "pyarrow>=17",
    "datasets>=3.0",
    "tqdm>=4.66",
]
VLLM = ["requests>=2.31"]
# torch is only the reference implementation in tests. It is pinned so that pip
# takes the CPU wheel and never resolves a CUDA build.
TEST = ["pytest>=8", "pytest-xdist>=3.5", "torch==2.13.0", "nbclient>=0.10", "nbformat>=5.10",
        "ipykernel>=6.29"]

setuptools.setup(
    name="isojax",
    version="0.1.0",
    description="IsoCompute RL sweeps in JAX: how to split a rollout budget "
    "between problems per batch, rollouts per problem and updates.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["isojax", "isojax.*"]),
    package_data={"isojax": ["assets/**/*"]},
    include_package_data=True,
    install_requires=ANALYSIS,
    extras_require={
        "analysis": [],  # the base install; named so the documented command works
        "train": TRAIN,
        "vllm": TRAIN + VLLM,
        "test": TRAIN + VLLM + TEST,
    },
    entry_points={
        "console_scripts": ["isojax-analyze=isojax.analysis.__main__:main"],
    },
)
