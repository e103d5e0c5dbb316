"""Offline mask discovery: calibration corpus, clustering, L0 mask training, baselines, evaluation."""
