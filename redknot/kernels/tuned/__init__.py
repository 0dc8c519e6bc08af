"""Shipped kernel launch choices (seeds of the tuning store): see ``redknot.kernels.tuning_cache``."""
