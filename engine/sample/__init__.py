"""Sampling: the request's parameters and the sampler over a step's logits."""
