"""isojax."""
