"""Studies: plan, run, resume and judge scaling sweeps, the optimization ladder and searches.

:mod:`.plan` (what a study runs), :mod:`.runner` (its MLflow record and progress lines, shared),
:mod:`.outcome` (what became of each point), :mod:`.sweep` and :mod:`.derived` (sweeps and the ladder),
:mod:`.search` (the Ray Tune search, a package). Nothing is imported here: each study imports what it runs.
"""
