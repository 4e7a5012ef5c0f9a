"""Shared test setup.

rayvit itself chooses Ray's authentication mode when it reaches Ray (``rayvit.launch.connect``): token
mode for a local instance, the cluster's own mode when attaching. Several tests call ``ray.init()``
themselves; Ray then turns token mode on too, but warns that it did. Ray caches RAY_AUTH_MODE when it is
imported, so saying so here, before any test module imports Ray, keeps their local instances on token
mode, quietly. Subprocesses that stand for users or cluster nodes get a clean environment
(``clusters.clean_env``), not this one.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")
