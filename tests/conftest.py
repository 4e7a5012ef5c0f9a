"""Shared test setup. Ray reads RAY_AUTH_MODE at import: set it before any test module imports Ray."""

import os

# A fresh local Ray turns token authentication on and warns; saying so explicitly keeps it on, quietly.
os.environ.setdefault("RAY_AUTH_MODE", "token")
