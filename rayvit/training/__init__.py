"""What one rank trains with, below the strategies that use it: precision levels, optimizers, checkpoint
files and the device's properties (peak rates, memory, names). No Ray, no loop.

Where this ends and :mod:`rayvit.worker` begins: ``training/`` holds pieces that each stand alone and that
:mod:`rayvit.strategies` imports (so it sits below them in the layers); ``worker/`` sits above the strategies
and puts a model, a strategy and these pieces together into a run (the loop, its session, metrics, saving
and resuming). docs/contributing.md ("Where the code lives") says more."""
