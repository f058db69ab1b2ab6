"""Committed assets (the tiny base model) and the scripts that make them."""
