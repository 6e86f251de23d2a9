"""Runs sized by a compute budget: this machine's calibration (`calibration`) and the arithmetic (`plan`)."""
