"""Projection: a performance and memory model of one training step per chip, at any chip count.

No Ray here (only ``collectives.measure_links`` launches Ray workers) and no torch.distributed at import.
"""
