"""The step contract: what one engine step hands to a model family and its kernels."""
