"""tf_dpnsgd: DP-NSGD and DP-SGD for TensorFlow 2.21 + Keras 3."""

import pathlib
import re

from setuptools import find_packages, setup

here = pathlib.Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "tf_dpnsgd" / "__init__.py").read_text()).group(1)

setup(
    name="tf_dpnsgd",
    version=version,
    description=("Differentially private normalized/clipped SGD (DP-NSGD, DP-SGD, DP-Adam, "
                 "DP-NAdam) for TensorFlow/Keras 3, with privacy accounting."),
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tf_dpnsgd", "tf_dpnsgd.*"]),
    python_requires=">=3.10,<3.13",
    install_requires=[
        # Tested with TF 2.21.0 / Keras 3.15.1 / dp-accounting 0.6.0 / absl-py 2.5.1.
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<4",
        "dp-accounting>=0.6,<0.7",
        "absl-py>=2.1,<3",
        "tensorboard>=2.20",  # tf.summary scalars (epsilon, loss, lr) for TensorBoard
        "numpy>=1.26,<3",
        "scipy>=1.10",
    ],
    extras_require={
        # pytest < 9.2: with 9.2 and pytest-xdist 3.8, --dist loadgroup silently ignores
        # xdist_group (pytest-xdist issue 1386): the launcher groups then run on both workers,
        # one waiting on the other's lock (tests/test_xdist_groups.py fails loudly if so).
        "test": ["pytest>=8,<9.2", "pytest-xdist>=3", "scikit-learn>=1.4", "matplotlib>=3.8",
                 "keras-hub>=0.32,<0.33", "safetensors>=0.4", "tensorflow-datasets>=4.9", "importlib_resources"],
        "experiments": ["scikit-learn>=1.4", "matplotlib>=3.8", "keras-hub>=0.32,<0.33",
                        "safetensors>=0.4", "tensorflow-datasets>=4.9", "importlib_resources"],
    },
    entry_points={"console_scripts": []},
)
