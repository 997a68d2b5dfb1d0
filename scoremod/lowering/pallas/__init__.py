"""The Pallas backend: block-sparse attention kernels generated from the IR (see backend.py)."""
