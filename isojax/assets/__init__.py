"""Committed assets: the tiny base model (made by launch/make_base_model.py) and its
difficulty splits (made by launch/difficulty_splits.py)."""
