"""Adapters of TokenSpeed's MLA kernels (``mla``)."""
