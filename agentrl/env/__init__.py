"""Environments: interactions (simulated users, judges), ToolEnv, and outcome rewards."""
