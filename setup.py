"""isojax: compute-optimal RL post-training budgets (Bp, n, M) in JAX."""

import setuptools

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
    install_requires=[
        # Pinned: the trainer's numerics (and the stored one-step regression
        # numbers in tests) are only reproducible on a fixed stack.
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "flax==0.12.8",
        "optax==0.2.8",
        "orbax-checkpoint==0.12.8",
        "transformers>=5.0,<6",
        "safetensors>=0.6",
        "numpy>=2.0",
        "scipy>=1.13",
        "matplotlib>=3.9",
        "absl-py>=2.1",
        "ml-collections>=1.0",
        "math-verify>=0.8",
        "tensorboardX>=2.6",
        "pyarrow>=17",
        "datasets>=3.0",
        "requests>=2.31",
        "tqdm>=4.66",
    ],
    extras_require={
        # torch is only the reference implementation in tests. It is pinned so
        # that pip takes the CPU wheel and never resolves a CUDA build.
        "test": ["pytest>=8", "torch==2.13.0", "nbclient>=0.10", "nbformat>=5.10",
                 "ipykernel>=6.29"],
    },
    entry_points={
        "console_scripts": ["isojax-analyze=isojax.analysis.__main__:main"],
    },
)
