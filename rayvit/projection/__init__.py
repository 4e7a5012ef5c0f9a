"""Projection: a performance and memory model of one training step per chip, at any chip count.

Each strategy supplies its own part of the model (``rayvit.strategies``, in the terms of
:mod:`rayvit.strategies.costs`); their libraries (FairScale) are not imported. No Ray here (only
``rayvit.launch.links_on_ray.measure_links`` launches Ray workers).
"""
