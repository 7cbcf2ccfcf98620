"""Build shim: the project's metadata is in pyproject.toml."""

from setuptools import setup

setup()
