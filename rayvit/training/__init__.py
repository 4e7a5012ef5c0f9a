"""What one rank trains with, below the strategies that use it: precision levels, optimizers, checkpoint
files and the device's properties (peak rates, memory, names). No Ray, no loop."""
