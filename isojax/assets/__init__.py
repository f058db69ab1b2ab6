"""Committed assets: the tiny base model (made by launch/make_base_model.py) and its
difficulty splits (made by launch/difficulty_splits.py)."""

import pathlib

ASSETS_DIR = pathlib.Path(__file__).resolve().parent
# What an empty config.model.path means, to the run and to the sweep launcher alike.
BASE_MODEL_DIR = ASSETS_DIR / "base_model"
