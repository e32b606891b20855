"""Turns a scheduled batch into one model forward and sampled tokens."""
