"""Advantage estimators, policy losses and KL estimators: pure tensor functions."""
