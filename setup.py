"""oapl_jax: OAPL (off-policy RL for LLM reasoning) in JAX / Flax NNX."""

from setuptools import find_packages, setup

# The test tools every test venv gets (the "test" extra adds torch, "test-no-torch" does not).
TEST_TOOLS = [
    "pytest>=8,<10",
    "pytest-xdist>=3.5,<4",  # `pytest -n 2`: the suite on two worker processes (README, .ci/run)
    "chex>=0.1.88,<0.2",
    "nbclient>=0.10,<0.12",  # tests/test_notebooks.py executes notebooks/*.ipynb
    "nbformat>=5.10,<6",
    "ipykernel>=6.29,<8",  # the notebooks' python3 kernel
    "gcsfs>=2025.3",  # tests/test_gcs_emulator.py: gs:// through fsspec's Cloud Storage client
    "gcp-storage-emulator>=2024.8",  # ... against this local Cloud Storage emulator
]

setup(
    name="oapl_jax",
    version="0.1.0",
    description="OAPL: least-squares off-policy RL with a lagged inference policy, in JAX/Flax NNX",
    python_requires=">=3.11",
    packages=find_packages(include=["oapl_jax", "oapl_jax.*"]),
    install_requires=[
        # Tested on 0.10.2 (Python 3.11) and 0.12.0.1 (Python 3.12); JAX 0.11+ needs Python >= 3.12,
        # so Python 3.11 gets 0.10.x. On TPU / GPUs the extras below add JAX's own TPU or CUDA build.
        "jax>=0.10,<0.13",
        "flax>=0.12,<0.13",
        "optax>=0.2.5,<0.3",
        "orbax-checkpoint>=0.11,<0.13",
        "google-jetstream==0.2.2",  # the only release; its engine API is what we implement
        "ml-collections>=1.0,<2",
        "absl-py>=2,<3",
        "tensorboard>=2.18,<3",  # its event protos and record writer (oapl_jax/metrics.py)
        "transformers>=4.50,<6",
        "safetensors>=0.4,<1",
        "tokenizers>=0.21,<1",
        "jinja2>=3.1,<4",  # transformers' apply_chat_template (torch brought it along until now)
        "tensorflow-datasets>=4.9,<5",
        "math-verify>=0.7,<1",
        "reasoning-gym>=0.1.25,<0.2",  # procedural tasks (oapl_jax/tasks/reasoning_gym.py)
        "google-cloud-storage>=2.14,<4",  # a gs:// workdir's lock: writes conditional on generations (oapl_jax/storage.py)
        "numpy>=1.26,<3",
        "matplotlib>=3.8,<4",
        "tqdm>=4.66,<5",
    ],
    extras_require={
        # The accelerator builds of the same JAX: pip install -e '.[tpu]' (libtpu) on a TPU VM,
        # '.[cuda12]' or '.[cuda13]' (JAX's CUDA plugin and NVIDIA's wheels) on a GPU machine.
        "tpu": ["jax[tpu]>=0.10,<0.13"],
        "cuda12": ["jax[cuda12]>=0.10,<0.13"],
        "cuda13": ["jax[cuda13]>=0.10,<0.13"],
        "test": TEST_TOOLS + [
            "torch==2.13.0",  # the CPU build on these machines; any other spec pulls a CUDA build
            "peft>=0.17,<1",  # tests/test_lora.py: the PEFT export loads onto the transformers model
        ],
        # The same without torch: .ci/run's Python 3.12 venv (the newest JAX), where torch has no
        # CPU wheel on these machines and any other torch is a multi-GB CUDA build; the tests that
        # need torch skip there (OAPL_NO_TORCH=1, tests/conftest.py), and fail wherever else it is missing.
        "test-no-torch": TEST_TOOLS,
    },
)
