"""Sparse autoencoders: the maths, SAELens's on-disk format, and feature readouts."""
