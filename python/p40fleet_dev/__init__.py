"""p40fleet's development harness: the sandbox fleet, the test fixtures and their commands.

Test and development code, kept out of the p40fleet wheel (pyproject.toml packages only p40fleet): an operator
runs what p40fleet carries, a developer runs `python -m p40fleet_dev` from a checkout, whose venv imports this
package from python/ (the editable install of p40fleet puts that directory on sys.path).
"""
