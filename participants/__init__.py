"""Participants of every kind and the reference Gym servers."""
