"""Packages and their folders (everything else is in pyproject.toml): ``recipes/`` and
``calibration/`` stay top-level folders of the repository but install under the ``qfuse``
namespace, so that they do not take the generic names ``recipes`` and ``calibration`` in a
user's site-packages."""

from setuptools import find_packages, setup

SUB = {"qfuse.recipes": "recipes", "qfuse.calibration": "calibration"}
packages = find_packages(include=["qfuse", "qfuse.*"])
for name, folder in SUB.items():
    packages += [name] + [f"{name}.{p}" for p in find_packages(folder)]

setup(
    packages=packages,
    package_dir=SUB,
    package_data={"qfuse.calibration": ["data/*.txt", "llm/*.txt", "llm/*.json",
                                        "llm/*.safetensors", "smollm2/*.txt"]},
)
