"""Triton kernels for Hopper (``hardware=sm90-port``); importing this package registers the
``triton`` backend of every op it accelerates (see :mod:`redknot.kernels.triton.ops`)."""
from redknot.kernels.triton import ops as _ops  # noqa: F401  (registration)
from redknot.kernels.triton import ops_mx as _ops_mx  # noqa: F401,E402  (V4.1 formats)
