"""Package data: the evaluation and calibration texts (see LICENSE-python-docs.txt)."""
