"""Rewards for RL (wired up in this package's __init__ once every module lands)."""
