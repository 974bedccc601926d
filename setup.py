"""The one part of the build pyproject.toml cannot say: find the packages and add the model zoo.

setuptools' find sees only folders under diffexport/; the zoo lives in top-level models/ and is
mapped to diffexport._zoo here (a find and a package-dir mapping cannot be combined in
pyproject.toml). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["diffexport", "diffexport.*"]) + ["diffexport._zoo"],
    package_dir={"diffexport._zoo": "models"},
)
