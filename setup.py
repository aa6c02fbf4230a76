"""Thin shim so `python setup.py develop` keeps working; metadata lives in pyproject.toml."""
from setuptools import setup

setup()
