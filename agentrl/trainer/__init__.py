"""Training: supervised warm-up on conversations (sft.py)."""
