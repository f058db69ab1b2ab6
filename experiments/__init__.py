"""Experiment configs: one `get_config(arg)` per study, run from the repo root."""
