"""cuTile kernels for the Mamba-2 SSD forward pass, and the public entry point.

    from ops import mamba_chunk_scan_combined
"""
from .ssd_combined import mamba_chunk_scan_combined

__all__ = ["mamba_chunk_scan_combined"]
